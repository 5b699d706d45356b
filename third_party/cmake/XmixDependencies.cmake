# What xmix's build needs from outside the repository, found here and nowhere else
# (third_party/README.md has each pin and its reason). Nothing is downloaded: every dependency
# comes from the system, the Python environment or the CUDA toolkit.
#
# Sets XMIX_WITH_CUDA (ON when the CUDA twins and the graph applier are built).

# ---------------------------------------------------------------- pins (README.md: why)
set(XMIX_MIN_CUDA_TOOLKIT 13.0)  # the graph applier calls CUDA 13's edge-data graph API
set(XMIX_MIN_PYBIND11 2.12)      # pyproject.toml [build-system] asks for the same
set(XMIX_MIN_GTEST 1.12)         # Debian bookworm's libgtest-dev (scripts/setup.sh)

# ---------------------------------------------------------------- CUDA (optional)
set(XMIX_WITH_CUDA OFF)
if(XMIX_ENABLE_CUDA)
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # sm_80 and sm_90 machine code, plus compute_90 PTX for newer GPUs.
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES "80-real;90-real;90-virtual")
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    if(CUDAToolkit_VERSION VERSION_LESS XMIX_MIN_CUDA_TOOLKIT)
      # A compile error in the applier would say less: name the version and the way out.
      message(FATAL_ERROR
        "xmix: CUDA toolkit ${CUDAToolkit_VERSION} found (${CMAKE_CUDA_COMPILER}); the CUDA "
        "kernels and the graph applier need ${XMIX_MIN_CUDA_TOOLKIT} or newer (CUDA 13's "
        "graph edge API with edge data). Install CUDA ${XMIX_MIN_CUDA_TOOLKIT}+, or build the "
        "CPU kernels only with -DXMIX_ENABLE_CUDA=OFF (pip: -C cmake.define.XMIX_ENABLE_CUDA=OFF).")
    endif()
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    set(XMIX_WITH_CUDA ON)
  endif()
endif()
if(XMIX_WITH_CUDA)
  message(STATUS "xmix: CUDA toolkit ${CUDAToolkit_VERSION} found; building CPU and CUDA kernels "
                 "for ${CMAKE_CUDA_ARCHITECTURES} (cudart linked statically)")
elseif(XMIX_ENABLE_CUDA)
  message(STATUS "xmix: no CUDA toolkit found; building the CPU kernels only")
else()
  message(STATUS "xmix: CUDA disabled (XMIX_ENABLE_CUDA=OFF); building the CPU kernels only")
endif()

# ---------------------------------------------------------------- Python and pybind11
# The interpreter the package is built for (scikit-build-core passes it), and pybind11's CMake
# config from that environment (pip's pybind11, a build requirement).
find_package(Python COMPONENTS Interpreter Development.Module REQUIRED)
find_package(pybind11 ${XMIX_MIN_PYBIND11} CONFIG REQUIRED)

# ---------------------------------------------------------------- GoogleTest (tests only)
# CMake's own FindGTest, on the system package (never fetched: no network at build time).
macro(xmix_find_gtest)
  find_package(GTest ${XMIX_MIN_GTEST} REQUIRED)
endmacro()
