/* Stand-in for the CUDA half-precision header (nccl.h includes it but declares nothing with it). */
