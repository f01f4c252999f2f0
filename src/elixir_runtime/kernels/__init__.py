"""Adam kernels over chunk shards: the torch reference, C++ on the CPU, Triton on CUDA; ``select`` picks one."""
