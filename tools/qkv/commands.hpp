// The subcommands of the qkv command-line tool. Each lives in its own file and registers
// itself on the app with one add_*_command call from main.cpp; its callback runs during
// app.parse(), so a qkv::Error it throws reaches main's handler.
#pragma once

namespace CLI {
class App;
}  // namespace CLI

namespace qkv::cli {

// `qkv demo`: a guided tour of attention, printed to stdout (demo.cpp).
void add_demo_command(CLI::App& app);

// `qkv viz`: attention weights as heatmaps per head, to PNG, SVG or PDF (viz.cpp).
void add_viz_command(CLI::App& app);

// `qkv memory`: the memory arithmetic of attention for a model, explained (memory.cpp).
void add_memory_command(CLI::App& app);

// `qkv scaling`: time and memory of the reference and flash kernels as N doubles (scaling.cpp).
void add_scaling_command(CLI::App& app);
// `qkv bench`: times the standard workloads W0-W5 against same-run sgemm and memcpy (bench.cpp).
void add_bench_command(CLI::App& app);

// `qkv train`: trains a small attention model on copy, recall or reverse (train.cpp).
void add_train_command(CLI::App& app);
// `qkv generate`: greedy generation with a trained model, with or without its KV cache (generate.cpp).
void add_generate_command(CLI::App& app);

// `qkv heads`: the role of every head of a Hugging Face model, measured on it (heads.cpp).
void add_heads_command(CLI::App& app);

#ifdef QKV_HAVE_DIST
// `qkv ring-bench`: ring attention over MPI, timed under mpirun (ring_bench.cpp); only when
// qkv was built with MPI (qkv::dist).
void add_ring_bench_command(CLI::App& app);
#endif
// `qkv serve`: the attention explorer, a local page and JSON API over HTTP (serve.cpp).
void add_serve_command(CLI::App& app);

}  // namespace qkv::cli
