// The shared memory one thread block may have on the current device: one definition for the
// selection point (family.cpp), the check before a launch (attention_cuda.cpp) and the fallback
// backward's choice of tiles (fallback/bwd_launch.cuh). No torch header: the .cu units include it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdlib>

namespace entropy_attn::cuda {

// The cap ENTROPY_ATTN_CUDA_SMEM_PER_BLOCK=N (bytes) puts on it, for tests and benchmarks: a GPU
// with more then runs every call as one with N would (101376: sm_86/89/120's, on an H100); 0 when
// unset or not a positive number (family.cpp: device_smem_optin rejects such a value, naming it).
inline long smem_cap_from_env() {
  const char* env = std::getenv("ENTROPY_ATTN_CUDA_SMEM_PER_BLOCK");
  if (env == nullptr || *env == '\0') return 0;
  char* end = nullptr;
  const long n = std::strtol(env, &end, 10);
  return *end == '\0' && n > 0 ? n : 0;
}

// The current device's dynamic shared memory per block (opted in), under the cap; 0 with the
// error of the query.
inline int smem_per_block(cudaError_t& err) {
  int device = 0, optin = 0;
  err = cudaGetDevice(&device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  const long cap = smem_cap_from_env();
  return cap > 0 && cap < optin ? static_cast<int>(cap) : optin;
}

}  // namespace entropy_attn::cuda
