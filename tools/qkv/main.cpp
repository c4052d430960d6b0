// qkv: the command-line front end of the qkv attention library. main() only builds the app,
// lets each subcommand register itself (commands.hpp) and turns errors into exit codes:
//   0 success, 2 a qkv::Error (bad input, message on stderr), CLI11's own codes for bad usage,
//   1 anything unexpected.
#include <csignal>
#include <cstdio>
#include <exception>
#include <string>

#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include "commands.hpp"
#include "qkv/qkv.hpp"

int main(int argc, char** argv) {
  // Past the file size limit (ulimit -f) a write then fails with EFBIG, which every writer reports
  // as an error, instead of the signal killing the process halfway through a file.
  std::signal(SIGXFSZ, SIG_IGN);
  CLI::App app{
      "qkv: scaled dot-product and multi-head attention for C++.\n"
      "See how attention works and measure what it costs.",
      "qkv"};
  app.set_version_flag("--version", fmt::format("qkv {}", qkv::version()),
                       "Print the version and exit");
  app.require_subcommand(1);

  qkv::cli::add_demo_command(app);
  qkv::cli::add_viz_command(app);
  qkv::cli::add_memory_command(app);
  qkv::cli::add_scaling_command(app);
  qkv::cli::add_bench_command(app);
  qkv::cli::add_train_command(app);
  qkv::cli::add_generate_command(app);
  qkv::cli::add_heads_command(app);
#ifdef QKV_HAVE_DIST
  qkv::cli::add_ring_bench_command(app);
#endif
  qkv::cli::add_serve_command(app);

  // After the subcommands: they copy the footer of their parent when they are created.
  app.footer("New to attention? Start with `qkv demo`.");

  try {
    app.parse(argc, argv);  // runs the chosen subcommand's callback
  } catch (const CLI::ParseError& e) {
    // CLI11 reports "A subcommand is required" for `qkv nope`; name the word it did not know.
    if (app.get_subcommands().empty() && !app.remaining().empty()) {
      const std::string word = app.remaining().front();
      fmt::print(stderr, "qkv: unknown {} '{}'\nRun `qkv --help` to see what qkv can do.\n",
                 word.starts_with('-') ? "option" : "command", word);
      return static_cast<int>(CLI::ExitCodes::ExtrasError);
    }
    return app.exit(e);  // --help, --version and other usage errors
  } catch (const qkv::Error& e) {
    fmt::print(stderr, "qkv: error: {}\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "qkv: internal error: {}\n", e.what());
    return 1;
  }
  return 0;
}
