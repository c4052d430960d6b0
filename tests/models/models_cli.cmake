# The qkv tool on Hugging Face model folders (tools/qkv/pretrained.cpp, heads.cpp), included from
# tests/CMakeLists.txt with the tool: qkv_make_tiny_model writes tiny random-weight folders of
# each architecture (config.json, model.safetensors, tokenizer.json), then the commands run on
# them for real. Uses cli_test (tests/cli/cli_tools.cmake).
add_executable(qkv_make_tiny_model models/make_tiny_model.cpp)
target_include_directories(qkv_make_tiny_model PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/models ${PROJECT_SOURCE_DIR}/src)
target_link_libraries(qkv_make_tiny_model PRIVATE qkv::qkv nlohmann_json::nlohmann_json)

set(tiny ${CMAKE_CURRENT_BINARY_DIR}/tiny_models)
foreach(arch gpt2 llama bert)
  add_test(NAME models_make_tiny_${arch} COMMAND qkv_make_tiny_model ${tiny}/${arch} ${arch})
  set_tests_properties(models_make_tiny_${arch} PROPERTIES FIXTURES_SETUP tiny_${arch})
endforeach()
add_test(NAME models_make_tiny_llama_bf16 COMMAND qkv_make_tiny_model ${tiny}/llama-bf16 llama bf16)
set_tests_properties(models_make_tiny_llama_bf16 PROPERTIES FIXTURES_SETUP tiny_llama_bf16)

# model_cli_test(name FIXTURE f ARGS ... [FILE ... KIND ...] EXPECT regex [FAIL])
function(model_cli_test name fixture)
  cli_test(${name} ${ARGN})
  set_tests_properties(${name} PROPERTIES FIXTURES_REQUIRED ${fixture})
endfunction()

model_cli_test(models_generate_gpt2 tiny_gpt2 ARGS "generate|--model|${tiny}/gpt2|the cat|--tokens|6|--ignore-eos"
  EXPECT "^the cat.*[0-9]+ prompt tokens: prefill [0-9.]+ tokens/s; 6 new tokens: decode [0-9.]+ tokens/s")
model_cli_test(models_generate_llama_sampled tiny_llama_bf16
  ARGS "generate|--model|${tiny}/llama-bf16|hello|--tokens|5|--temperature|0.8|--top-k|20|--top-p|0.9|--seed|3|--ignore-eos"
  EXPECT "5 new tokens: decode")
# Several prompts: generated together on int8 pages, each printed with its continuation.
model_cli_test(models_generate_batch_int8 tiny_llama
  ARGS "generate|--model|${tiny}/llama|the cat|hello there friend|--tokens|4|--ignore-eos|--kv-dtype|int8"
  EXPECT "\\[0\\] the cat.*\\[1\\] hello there friend.*2 prompts together, [0-9]+ prompt tokens: prefill [0-9.]+ tokens/s; 8 new tokens: decode [0-9.]+ tokens/s")
model_cli_test(models_generate_bert_refused tiny_bert ARGS "generate|--model|${tiny}/bert|the cat" FAIL
  EXPECT "BertForMaskedLM, an encoder")
model_cli_test(models_generate_qkv_options_refused tiny_gpt2 ARGS "generate|--model|${tiny}/gpt2|the|--plot|x.png" FAIL
  EXPECT "go with a .qkv model")
model_cli_test(models_viz_llama tiny_llama ARGS "viz|--model|${tiny}/llama|the cat sat|-o|${cli_out}/llama_heads.png"
  FILE ${cli_out}/llama_heads.png KIND png EXPECT "Wrote layer [0-9]+'s 4 heads on [0-9]+ tokens")
model_cli_test(models_viz_bert_layer tiny_bert ARGS "viz|--model|${tiny}/bert|the cat sat on the mat|--layer|1|-o|${cli_out}/bert_heads.svg"
  FILE ${cli_out}/bert_heads.svg KIND svg EXPECT "Wrote layer 1's 3 heads on 8 tokens")
model_cli_test(models_viz_bad_layer tiny_gpt2 ARGS "viz|--model|${tiny}/gpt2|the|--layer|7|-o|${cli_out}/x.png" FAIL
  EXPECT "--layer 7 is not a layer of .*layers 0 to 1")
model_cli_test(models_heads_gpt2 tiny_gpt2 ARGS "heads|--model|${tiny}/gpt2|-o|${cli_out}/gpt2_roles.png"
  FILE ${cli_out}/gpt2_roles.png KIND png EXPECT "layer +head +previous +first +self +induction +broad +role.*8 heads:")
model_cli_test(models_heads_bert tiny_bert ARGS "heads|--model|${tiny}/bert|the cat sat on the mat" EXPECT "6 heads:")
# A folder without its weights: the error names the folder and what it looked for.
add_test(NAME models_make_no_weights COMMAND ${CMAKE_COMMAND} -E copy ${tiny}/gpt2/config.json ${tiny}/no-weights/config.json)
set_tests_properties(models_make_no_weights PROPERTIES FIXTURES_SETUP tiny_no_weights FIXTURES_REQUIRED tiny_gpt2)
model_cli_test(models_folder_without_weights tiny_no_weights ARGS "generate|--model|${tiny}/no-weights|x" FAIL
  EXPECT "no-weights.*model.safetensors")
# qkv heads on a GPT-2 whose weights are set by hand (induction_model.hpp): layer 0 head 0 a
# previous-token head, layer 1 head 0 an induction head, the other two uniform. The tool must
# name exactly those: the two rows, their scores, and the count of each role.
add_test(NAME models_make_hand_set COMMAND qkv_make_tiny_model ${tiny}/hand-set gpt2-induction)
set_tests_properties(models_make_hand_set PROPERTIES FIXTURES_SETUP tiny_hand_set)
model_cli_test(models_heads_hand_set tiny_hand_set ARGS "heads|--model|${tiny}/hand-set"
  EXPECT " 0 +0 +(0\\.9[0-9]+|1\\.000) +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+  previous-token.* 1 +0 +[0-9.]+ +[0-9.]+ +[0-9.]+ +(0\\.[89][0-9]+|1\\.000) +[0-9.]+  induction.*4 heads: 1 previous-token, 1 induction, 2 broad")
