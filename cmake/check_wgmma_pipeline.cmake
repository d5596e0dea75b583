# ctest tree_attention_wgmma_pipelined: compiles kernels/tree_attention.cu for sm_90a with
# ptxas's report on and fails where ptxas serialises the wgmma products (its "Potential
# Performance Loss: wgmma.mma_async instructions are serialized ..." advisories, or an
# injected warpgroup.arrive). Such a kernel compiles and passes the GPU tests but waits for
# every product before issuing the next (register pressure can cause it), which makes the wide
# tree plans markedly slower. ptxas prints these as "info", so no warning flag turns them into
# a build error.
# Inputs: NVCC, ROOT (the source tree), SRC, OUT (the cubin to write).
execute_process(
  COMMAND ${NVCC} -std=c++17 -O3 -DNDEBUG -DTREESERVE_HAVE_CUDA=1 -I${ROOT} -arch=sm_90a -cubin
          -Xptxas -v -o ${OUT} ${SRC}
  RESULT_VARIABLE rc
  OUTPUT_VARIABLE out
  ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "nvcc failed (${rc}):\n${err}")
endif()
set(report "${out}${err}")
# The check means something only where ptxas reported on the wgmma kernel.
if(NOT report MATCHES "Compiling entry function '[^']*tree_attention_stage1ILi128E")
  message(FATAL_ERROR "no ptxas report for tree_attention_stage1<128, ...>:\n${report}")
endif()
string(REGEX MATCHALL "[^\n]*(Performance Loss|is injected)[^\n]*" hits "${report}")
if(hits)
  string(REPLACE ";" "\n" hits "${hits}")
  message(FATAL_ERROR "ptxas serialises wgmma in ${SRC}:\n${hits}")
endif()
message(STATUS "ptxas keeps the wgmma products of ${SRC} pipelined (sm_90a)")
