# Tests of `qkv serve`, the attention explorer (tools/qkv/serve.cpp), included from
# tests/CMakeLists.txt when the tool is built:
#
#   serve_api_tests     GoogleTest on the mask expressions and the JSON API as functions
#   serve_cache_tests   GoogleTest on the per-folder cache: roles, neuron rows, threads at once
#   serve_model_train   fixture: a tiny trained model for the servers to load
#   serve_http          the API over HTTP against `qkv serve --port 0` on 127.0.0.1 (pytest)
#   serve_browser       the page in headless Chromium: slider, causal, screenshots (pytest + Selenium)
#   serve_browser_models  the page on Hugging Face folders (qkv_make_tiny_model's): model view,
#                       head view toggles, neuron view, prediction (pytest + Selenium)
#   serve_overview      the long-document overview: API, bad input, Chromium timing (pytest + Selenium)
#   serve_load          8 clients x 200 requests on 127.0.0.1: no error, no memory growth
#   serve_connections   slow, idle and bursting clients against one server (pytest)
#   serve_probe         probe_server.py at its CI size: bad Hosts, NUL bytes, oversize and
#                       malformed bodies, slow and idle clients, bursts; no crash, no hang
#
# The Python tests need only python3 and pytest (the browser test also python3-selenium,
# chromium and chromium-driver, which scripts/install-deps.sh installs).

add_executable(serve_api_tests ${CMAKE_CURRENT_LIST_DIR}/test_serve_api.cpp)
target_link_libraries(serve_api_tests PRIVATE qkv_explorer_api GTest::gtest_main)
# ExplorerFolders.* run on qkv_make_tiny_model's folders (models_cli.cmake's fixtures).
gtest_discover_tests(serve_api_tests DISCOVERY_TIMEOUT 60 PROPERTIES ENVIRONMENT "QKV_TINY=${tiny}"
  FIXTURES_REQUIRED "tiny_gpt2;tiny_llama;tiny_bert")
# The per-folder cache (serve_folder_cache.hpp): roles, the neuron view's q and k, threads at once.
add_executable(serve_cache_tests ${CMAKE_CURRENT_LIST_DIR}/test_serve_cache.cpp)
target_link_libraries(serve_cache_tests PRIVATE qkv_explorer_api GTest::gtest_main)
gtest_discover_tests(serve_cache_tests DISCOVERY_TIMEOUT 60 PROPERTIES ENVIRONMENT "QKV_TINY=${tiny}"
  FIXTURES_REQUIRED "tiny_gpt2;tiny_llama;tiny_bert")

set(serve_out ${CMAKE_CURRENT_BINARY_DIR}/serve)
file(MAKE_DIRECTORY ${serve_out})
add_test(NAME serve_model_train COMMAND qkv_cli train --task copy --length 3 --symbols 4 --steps 20 --eval 16
  --save ${serve_out}/copy.qkv)
set_tests_properties(serve_model_train PROPERTIES FIXTURES_SETUP serve_model TIMEOUT 60
  PASS_REGULAR_EXPRESSION "Saved the model to")

find_program(QKV_PYTHON3 NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
if(NOT QKV_PYTHON3)
  find_program(QKV_PYTHON3 python3 REQUIRED)
endif()
# ASan's quarantine would hold freed memory back for up to 256 MiB and look like growth to the
# load test; a small one keeps use-after-free detection without that.
set(serve_env "QKV_BIN=$<TARGET_FILE:qkv_cli>" "QKV_MODEL=${serve_out}/copy.qkv" "QKV_OUT=${serve_out}" "QKV_TINY=${tiny}"
  "ASAN_OPTIONS=quarantine_size_mb=4" "PYTHONDONTWRITEBYTECODE=1")
if(QKV_SANITIZE)
  list(APPEND serve_env "QKV_SANITIZED=1")  # test_load.py: the allocator's own growth, bounded looser
endif()
foreach(name http browser load connections)
  set(file test_api.py)
  if(NOT name STREQUAL "http")
    set(file test_${name}.py)
  endif()
  add_test(NAME serve_${name}
    COMMAND ${QKV_PYTHON3} -m pytest -q -s -p no:cacheprovider -rs ${CMAKE_CURRENT_LIST_DIR}/${file})
  set_tests_properties(serve_${name} PROPERTIES ENVIRONMENT "${serve_env}" FIXTURES_REQUIRED serve_model
    TIMEOUT 300)
endforeach()
add_test(NAME serve_browser_models
  COMMAND ${QKV_PYTHON3} -m pytest -q -s -p no:cacheprovider -rs ${CMAKE_CURRENT_LIST_DIR}/test_browser_models.py)
set_tests_properties(serve_browser_models PROPERTIES ENVIRONMENT "${serve_env}"
  FIXTURES_REQUIRED "tiny_gpt2;tiny_bert" TIMEOUT 300)
# The long-document overview (POST /api/overview, explorer/overview.js) on the tiny llama made
# to take 4096 positions: its API, bad input, and its drawing in Chromium within 1.5 s.
add_test(NAME serve_overview
  COMMAND ${QKV_PYTHON3} -m pytest -q -s -p no:cacheprovider -rs ${CMAKE_CURRENT_LIST_DIR}/test_overview.py)
set_tests_properties(serve_overview PROPERTIES ENVIRONMENT "${serve_env}" FIXTURES_REQUIRED "tiny_llama" TIMEOUT 300)
# serve_http's last test runs qkv_make_tiny_model's folders over HTTP.
set_tests_properties(serve_http PROPERTIES FIXTURES_REQUIRED "serve_model;tiny_gpt2;tiny_bert")
add_test(NAME serve_probe COMMAND ${QKV_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/probe_server.py --qkv $<TARGET_FILE:qkv_cli>)
set_tests_properties(serve_probe PROPERTIES ENVIRONMENT "${serve_env}" TIMEOUT 120)
# The load test measures memory and speed, and the connection tests time requests: alone, not
# beside the rest of the suite.
set_tests_properties(serve_load serve_connections PROPERTIES RUN_SERIAL TRUE)
# COST (seconds, roughly, under ASan + UBSan): `ctest -j` starts the costliest tests first; a
# clean checkout has no timing history, so without it these start in declaration order.
set_tests_properties(serve_http PROPERTIES COST 75)
set_tests_properties(serve_browser PROPERTIES COST 70)
