# `make docs-images`: regenerates the figures the tool pages show (docs/viz.md, docs/scaling.md)
# with the commands those pages quote, into docs/images/. Included from tools/qkv/CMakeLists.txt.
# The scaling figure is measured on the machine that runs it (about a minute).
set(docs_images ${PROJECT_SOURCE_DIR}/docs/images)
add_custom_target(docs-images
  COMMAND ${CMAKE_COMMAND} -E make_directory ${docs_images}
  COMMAND qkv_cli viz --text "The cat sat on the mat" --heads 8 --embed 64 -o ${docs_images}/viz-heads.png
  COMMAND qkv_cli viz --causal -o ${docs_images}/viz-causal.png
  COMMAND qkv_cli viz --temperature 0.5,1,2 -o ${docs_images}/viz-temperature.png
  COMMAND qkv_cli viz --compare-heads 1,8 -o ${docs_images}/viz-compare-heads.png
  COMMAND qkv_cli scaling -o ${docs_images}/scaling.png
  DEPENDS qkv_cli
  COMMENT "Drawing the documentation's figures into docs/images/"
  VERBATIM)
