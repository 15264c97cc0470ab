# ctest python.install: installs the python component into the stage STAGE (a DESTDIR) and imports c2f from
# there, in a fresh interpreter that cannot see the build tree.
file(REMOVE_RECURSE ${STAGE})
execute_process(COMMAND ${CMAKE_COMMAND} -E env DESTDIR=${STAGE} ${CMAKE_COMMAND} --install ${BINARY_DIR} --component python
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "cmake --install --component python failed (${rc})")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E env PYTHONPATH=${STAGE}/${SITEARCH} PYTHONNOUSERSITE=1
                        ${PYTHON} -c "import c2f, sys; print(c2f.__file__); l = c2f.MultiHeadAttention(8, 2); print(l)"
                WORKING_DIRECTORY ${STAGE} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(rc OR NOT out MATCHES "${STAGE}")
  message(FATAL_ERROR "the installed c2f did not import from ${STAGE}/${SITEARCH}")
endif()
