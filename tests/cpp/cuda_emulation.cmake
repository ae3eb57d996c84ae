# The CPU emulation test of the CUDA kernels (test_cuda_emulation.cpp with cuda_emulation.h): the
# fallback kernels of csrc/cuda/fallback/*_kernel.cuh compiled by the host compiler and run on emulated thread blocks,
# against a float64 reference. Included from tests/cpp/CMakeLists.txt, after ${_ea_gtest_main} is
# set; tests/cpp/CMakeLists.txt's glob of *.cpp must leave test_cuda_emulation.cpp out.
#
# Only for builds with the CUDA sources: the test uses csrc/cuda/attention_host.cpp (part of the
# entropy_attn library only then) and the CUDA toolkit's headers (cuda_fp16.h, cuda_bf16.h,
# vector_types.h, mma.h); it needs no GPU and runs everywhere such a build runs.

# The library has the CUDA sources when the top-level CMakeLists.txt resolved its CUDA switch
# (ENTROPY_ATTN_CUDA = AUTO/ON/OFF) to _ea_cuda = ON, with the CUDA language enabled: CMake then
# knows the toolkit's include directories.
if(_ea_cuda)
  find_package(Threads REQUIRED)
  add_executable(test_cuda_emulation "${CMAKE_CURRENT_LIST_DIR}/test_cuda_emulation.cpp")
  target_link_libraries(test_cuda_emulation PRIVATE entropy_attn ${_ea_gtest_main}
                                                    Threads::Threads)
  target_include_directories(test_cuda_emulation PRIVATE "${PROJECT_SOURCE_DIR}/csrc")
  target_include_directories(test_cuda_emulation SYSTEM PRIVATE
                             ${CMAKE_CUDA_TOOLKIT_INCLUDE_DIRECTORIES})
  target_compile_features(test_cuda_emulation PRIVATE cxx_std_20)  # std::barrier-era atomics
  # As the .cu files are compiled (CMakeLists.txt, setup.py): the kernels must not rely on the
  # implicit __half / __nv_bfloat16 conversions and operators.
  target_compile_definitions(test_cuda_emulation PRIVATE
    __CUDA_NO_HALF_OPERATORS__ __CUDA_NO_HALF_CONVERSIONS__
    __CUDA_NO_BFLOAT16_CONVERSIONS__ __CUDA_NO_HALF2_OPERATORS__)
  # The kernels' `#pragma unroll` means nothing to g++ (and GCC < 13 cannot silence it from a
  # pragma in the header).
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(test_cuda_emulation PRIVATE -Wno-unknown-pragmas)
  endif()
  # The host instantiations of the __global__ kernel templates have the mangled names of the
  # launch stubs nvcc put in libentropy_attn.so: keep them out of the dynamic symbol table, so
  # that neither interposes on the other.
  set_target_properties(test_cuda_emulation PROPERTIES
    CXX_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON
    RUNTIME_OUTPUT_DIRECTORY "${PROJECT_BINARY_DIR}/bin")
  if(ENTROPY_ATTN_CTEST_PER_CASE)
    gtest_discover_tests(test_cuda_emulation
      DISCOVERY_MODE PRE_TEST
      DISCOVERY_TIMEOUT 120
      PROPERTIES TIMEOUT 600 LABELS "cpp;cuda_emulation")
  else()
    add_test(NAME test_cuda_emulation COMMAND test_cuda_emulation --gtest_color=no)
    set_tests_properties(test_cuda_emulation PROPERTIES TIMEOUT 600 LABELS "cpp;cuda_emulation")
    if(ENTROPY_ATTN_SANITIZE)
      set_property(TEST test_cuda_emulation APPEND PROPERTY ENVIRONMENT ${_ea_sanitizer_env})
    endif()
  endif()
endif()
