"""The dataset index: listed files, their footers (read once, cached on disk, shared by a job)
and content fingerprints, and the byte-bounded splits cut from them. The only planning step that
does I/O."""
