# The CPU emulation test of the CUDA kernels (test_cuda_emulation.cpp with cuda_emulation.h): the
# kernels of csrc/cuda/*_kernel.cuh compiled by the host compiler and run on emulated thread blocks,
# against a float64 reference. Included from tests/cpp/CMakeLists.txt, after ${_ea_gtest_main} is
# set; tests/cpp/CMakeLists.txt's glob of *.cpp must leave test_cuda_emulation.cpp out.
#
# Only for builds with the CUDA sources: the test uses csrc/cuda/attention_host.cpp (part of the
# entropy_attn library only then) and the CUDA toolkit's headers (cuda_fp16.h, cuda_bf16.h,
# vector_types.h, mma.h); it needs no GPU and runs everywhere such a build runs.

# The library has the CUDA sources when the top-level CMakeLists.txt resolved its CUDA switch
# (ENTROPY_ATTN_CUDA = AUTO/ON/OFF) to _ea_cuda = ON; it then also carries ENTROPY_ATTN_WITH_CUDA=1
# in its interface (checked as well, should the variable's name change).
set(_ea_emu_enabled OFF)
if(_ea_cuda)
  set(_ea_emu_enabled ON)
elseif(TARGET entropy_attn)
  get_target_property(_ea_emu_defs entropy_attn INTERFACE_COMPILE_DEFINITIONS)
  if(_ea_emu_defs AND "ENTROPY_ATTN_WITH_CUDA=1" IN_LIST _ea_emu_defs)
    set(_ea_emu_enabled ON)
  endif()
endif()

if(_ea_emu_enabled)
  # The toolkit's include directory (with cuda_fp16.h): from find_package(CUDAToolkit) (run by
  # Caffe2's config for CUDA builds of torch), from CMake's CUDA language support, from
  # CUDA_TOOLKIT_ROOT_DIR, or next to nvcc's real location (nvcc may be a wrapper script elsewhere).
  set(_ea_emu_hints "")
  if(CUDAToolkit_INCLUDE_DIRS)
    list(APPEND _ea_emu_hints ${CUDAToolkit_INCLUDE_DIRS})
  endif()
  foreach(_root IN ITEMS "${CMAKE_CUDA_COMPILER_TOOLKIT_ROOT}" "${CUDAToolkit_ROOT}"
                         "${CUDA_TOOLKIT_ROOT_DIR}" "$ENV{CUDA_HOME}" "$ENV{CUDA_PATH}")
    if(_root)
      list(APPEND _ea_emu_hints "${_root}/include" "${_root}/targets/x86_64-linux/include"
           "${_root}/targets/sbsa-linux/include")
    endif()
  endforeach()
  set(_ea_emu_nvcc "${CMAKE_CUDA_COMPILER}")
  if(NOT _ea_emu_nvcc)
    find_program(ENTROPY_ATTN_EMULATION_NVCC nvcc)
    set(_ea_emu_nvcc "${ENTROPY_ATTN_EMULATION_NVCC}")
  endif()
  if(_ea_emu_nvcc)
    get_filename_component(_ea_emu_nvcc_real "${_ea_emu_nvcc}" REALPATH)
    get_filename_component(_ea_emu_nvcc_dir "${_ea_emu_nvcc_real}" DIRECTORY)
    list(APPEND _ea_emu_hints "${_ea_emu_nvcc_dir}/../include")
    # A wrapper script's directory is not the toolkit's: ask nvcc where its toolkit is (TOP=).
    file(WRITE "${CMAKE_CURRENT_BINARY_DIR}/ea_emu_probe.cu" "")
    execute_process(COMMAND "${_ea_emu_nvcc}" --dryrun -v -c
                            "${CMAKE_CURRENT_BINARY_DIR}/ea_emu_probe.cu"
                    OUTPUT_VARIABLE _ea_emu_out ERROR_VARIABLE _ea_emu_out
                    RESULT_VARIABLE _ea_emu_rc TIMEOUT 60)
    if(_ea_emu_out MATCHES "TOP=([^\r\n]*)")
      string(STRIP "${CMAKE_MATCH_1}" _ea_emu_top)
      list(APPEND _ea_emu_hints "${_ea_emu_top}/include" "${_ea_emu_top}/targets/x86_64-linux/include"
           "${_ea_emu_top}/targets/sbsa-linux/include")
    endif()
  endif()
  list(APPEND _ea_emu_hints /usr/local/cuda/include)
  find_path(ENTROPY_ATTN_CUDA_INCLUDE_DIR NAMES cuda_fp16.h HINTS ${_ea_emu_hints}
            DOC "CUDA toolkit include directory (cuda_fp16.h) for test_cuda_emulation")

  if(NOT ENTROPY_ATTN_CUDA_INCLUDE_DIR)
    message(WARNING "entropy_attn: cuda_fp16.h not found (set ENTROPY_ATTN_CUDA_INCLUDE_DIR): "
                    "test_cuda_emulation is not built")
  else()
    find_package(Threads REQUIRED)
    add_executable(test_cuda_emulation "${CMAKE_CURRENT_LIST_DIR}/test_cuda_emulation.cpp")
    target_link_libraries(test_cuda_emulation PRIVATE entropy_attn ${_ea_gtest_main}
                                                      Threads::Threads)
    target_include_directories(test_cuda_emulation PRIVATE "${PROJECT_SOURCE_DIR}/csrc")
    target_include_directories(test_cuda_emulation SYSTEM PRIVATE "${ENTROPY_ATTN_CUDA_INCLUDE_DIR}")
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
    endif()
  endif()
endif()
