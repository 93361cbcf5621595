# EPFlow as a CMake package: the names a consumer links and the install rules behind
# find_package(epflow). Included from the top-level CMakeLists.txt after add_subdirectory(src).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# A consumer links epflow::epflow (the layer) or epflow::reference (the CPU reference), installed
# (EXPORT_NAME below the epflow:: namespace) or add_subdirectory()'d (the ALIAS targets) alike.
# The other three are exported only because those two link them.
set_target_properties(epflow_reference PROPERTIES EXPORT_NAME reference)
set_target_properties(epflow_core PROPERTIES EXPORT_NAME core)
set_target_properties(epflow_common PROPERTIES EXPORT_NAME common)
set_target_properties(epflow_nccl PROPERTIES EXPORT_NAME nccl)
add_library(epflow::epflow ALIAS epflow)
add_library(epflow::reference ALIAS epflow_reference)

# Static libraries whose CUDA code is whole-program compiled (no separable compilation): nothing
# is left for a device-link step, so a consumer links them with its C++ linker and CUDA::cudart.
# Only include/epflow is installed: the src/ headers the libraries build with stay out of the
# installed interface (src/CMakeLists.txt names them in $<BUILD_INTERFACE:...> only).
install(TARGETS epflow epflow_core epflow_common epflow_nccl epflow_reference
        EXPORT epflowTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/epflow DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.h")

set(_epflow_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/epflow)
install(EXPORT epflowTargets NAMESPACE epflow:: DESTINATION ${_epflow_cmake_dir})
configure_package_config_file(
  ${PROJECT_SOURCE_DIR}/cmake/epflowConfig.cmake.in ${PROJECT_BINARY_DIR}/epflowConfig.cmake
  INSTALL_DESTINATION ${_epflow_cmake_dir})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/epflowConfigVersion.cmake
                                 COMPATIBILITY SameMajorVersion)
install(FILES ${PROJECT_BINARY_DIR}/epflowConfig.cmake
              ${PROJECT_BINARY_DIR}/epflowConfigVersion.cmake
        DESTINATION ${_epflow_cmake_dir})
