"""Constants shared by the sm_90 forward's work lists (torch) and kernel (CuTe DSL); imports nothing."""

QBITS = 8  # bits of a work-list entry's query mask: tiles of up to 8 queries
HPG = 16  # query heads per kv group the kernel takes (the rows of one query)
HEAD_DIM = 128  # head dim the kernel takes
BLOCK = 128  # key block size the kernel takes (one TMA box, one MMA N tile)
MB_QUERIES = 4  # queries per m-block of the backward (x HPG heads = 64 MMA rows)
MB_BITS = 4  # bits of a backward work-list entry's query mask (one per query of the m-block)
