"""CP algorithms, one a file, each written against `cpref.comm` and `cpref.kernels`."""
