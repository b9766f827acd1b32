# CMake toolchain: cross-compile ktd's native module for aarch64 Linux with Debian's
# g++-aarch64-linux-gnu, against the Python headers of an arm64 Debian 12 root (KTD_ARM64_ROOT,
# made by tools/arm64/make-root.sh). The module runs in that root (tools/arm64/test-arm64.sh).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)

if(NOT KTD_ARM64_ROOT)
  set(KTD_ARM64_ROOT "$ENV{KTD_ARM64_ROOT}")
endif()
# try_compile projects include this file again: hand them the root.
list(APPEND CMAKE_TRY_COMPILE_PLATFORM_VARIABLES KTD_ARM64_ROOT)
if(NOT KTD_ARM64_ROOT OR NOT EXISTS "${KTD_ARM64_ROOT}/usr/include/python3.11/Python.h")
  message(FATAL_ERROR "KTD_ARM64_ROOT (${KTD_ARM64_ROOT}) is not an arm64 root with python3-dev "
                      "(make it with tools/arm64/make-root.sh)")
endif()
# The root's headers come after the cross toolchain's own (libc, libstdc++): only what the
# toolchain lacks — pyconfig.h under aarch64-linux-gnu/python3.11 — is taken from the root.
set(CMAKE_CXX_FLAGS_INIT "-idirafter ${KTD_ARM64_ROOT}/usr/include")
set(Python_INCLUDE_DIR "${KTD_ARM64_ROOT}/usr/include/python3.11" CACHE PATH "" FORCE)
set(Python_SOABI "cpython-311-aarch64-linux-gnu" CACHE STRING "" FORCE)
# pybind11 asks the host interpreter (x86-64) for the module suffix: CMakeLists.txt sets this one
# on the module instead.
set(KTD_PYTHON_EXT_SUFFIX ".cpython-311-aarch64-linux-gnu.so")
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
