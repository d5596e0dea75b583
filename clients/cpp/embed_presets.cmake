# Writes OUT, a C++ header holding the text of IN (clients/loadtest_presets.json) as the raw
# string literal kPresetsJson, so treeserve_loadtest needs no file at run time (it is copied
# alone to the GPU boxes). Run at build time by the custom command in CMakeLists.txt, which
# re-runs it whenever the JSON changes. A file CMake cannot parse fails the build here (CMake
# lets a trailing comma through; nlohmann, parsing it at startup, does not).
# usage: cmake -DIN=clients/loadtest_presets.json -DOUT=.../loadtest_presets_json.h -P THIS
file(READ "${IN}" json)
string(JSON type ERROR_VARIABLE error TYPE "${json}")
if(error)
  message(FATAL_ERROR "${IN} is not valid JSON: ${error}")
endif()
# The literal's delimiter must not occur in the text (a raw string ends at its first )delim").
set(delimiter presets_json)
string(FIND "${json}" ")${delimiter}\"" at)
if(NOT at EQUAL -1)
  message(FATAL_ERROR "${IN} contains )${delimiter}\", which ends the raw string literal")
endif()
file(WRITE "${OUT}" "// Generated from ${IN} by clients/cpp/embed_presets.cmake: edit the JSON.
#pragma once

namespace treeserve::loadtest {

inline constexpr char kPresetsJson[] = R\"${delimiter}(${json})${delimiter}\";

}  // namespace treeserve::loadtest
")
