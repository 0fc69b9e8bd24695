"""Reading one stream: its pieces decoded from a position, shuffle windows, exact-size batches
with provenance, token packing, conversion to the output type, and the packets a worker sends."""
