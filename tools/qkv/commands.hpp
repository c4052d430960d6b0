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

}  // namespace qkv::cli
