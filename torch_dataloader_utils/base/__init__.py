"""The bottom layer: exceptions, the logger, checked arguments, who this process is, arrays and
jagged values, row widths, and every private API of another library. Imports no other folder."""
