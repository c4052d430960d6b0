// `qkv serve`: the attention explorer, one page and a JSON API on a local HTTP server.
//
//   qkv serve                                  # http://127.0.0.1:8080/
//   qkv serve --port 0                         # any free port; the URL printed says which
//   qkv serve --model copy.qkv --model recall.qkv
//
// The page (tools/qkv/explorer/, embedded in the binary at build time) asks POST /api/attention
// for weights and draws them; the API's requests and answers are in serve_api.hpp. Safety:
// loopback unless --host names another address (then a warning), requests whose Host header is
// not this machine's refused while on loopback (a web page elsewhere cannot use a browser to
// reach the explorer by DNS rebinding), body and text limits, models only from the files named
// here, at most --max-concurrent computations at once (others wait, then get 503), and Ctrl-C
// (SIGINT) or SIGTERM stops it cleanly.
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <memory>
#include <semaphore>
#include <string>
#include <thread>
#include <vector>

#include <fmt/core.h>
#include <httplib.h>
#include <CLI/CLI.hpp>

#include "commands.hpp"
#include "explorer_assets.hpp"
#include "qkv/error.hpp"
#include "serve_api.hpp"

namespace qkv::cli {
namespace {

struct ServeOptions {
  std::string host = "127.0.0.1";
  int port = 8080;
  std::vector<std::string> models;
  int max_concurrent = 4;
  double queue_seconds = 10;  // how long a request waits for a computation slot before a 503
};

// The most computations --max-concurrent may allow; the semaphore's compile-time bound.
constexpr int kMaxConcurrentLimit = 64;

// The host part of a Host header: "127.0.0.1:8080" -> "127.0.0.1", "[::1]:80" -> "[::1]".
std::string host_name(const std::string& header) {
  if (header.starts_with("[")) return header.substr(0, header.find(']') + 1);
  return header.substr(0, header.find(':'));
}

// The charset parameter keeps cpp-httplib from compressing the answer (it compresses exactly
// "application/json" for a client that accepts it): Brotli took 1.3 s and gzip 0.4 s for a
// 64-token, 16-head answer (578 KB) that the computation and the loopback send in 25 ms.
void set_json(httplib::Response& response, int status, const std::string& body) {
  response.status = status;
  response.set_content(body, "application/json; charset=utf-8");
}

// The stop signal received (SIGINT or SIGTERM), 0 until then. Set by on_stop_signal in whichever
// thread the kernel picks (OpenBLAS starts its threads before main), read by run_serve's stopper.
volatile std::sig_atomic_t g_stop_signal = 0;

extern "C" void on_stop_signal(int signal) { g_stop_signal = signal; }

// Installs on_stop_signal for SIGINT and SIGTERM. sigaction replaces even an ignored action: a
// shell starts a background job with SIGINT ignored, and Ctrl-C must still stop the server.
void catch_stop_signals() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
}

void run_serve(const ServeOptions& o) {
  if (o.max_concurrent < 1 || o.max_concurrent > kMaxConcurrentLimit) {
    throw Error(fmt::format("--max-concurrent must be between 1 and {}, got {}", kMaxConcurrentLimit, o.max_concurrent));
  }
  if (o.port < 0 || o.port > 65535) throw Error(fmt::format("--port must be between 0 and 65535, got {}", o.port));
  const ExplorerApi api(o.models, ServeLimits{});
  const bool loopback = is_loopback_host(o.host);
  if (!loopback) {
    fmt::print(stderr,
               "qkv serve: warning: listening on {}, not loopback: anyone who can reach this machine on that "
               "address can use the explorer. Leave out --host to keep it to this machine (127.0.0.1).\n",
               o.host);
  }

  httplib::Server server;
  std::counting_semaphore<kMaxConcurrentLimit> slots(o.max_concurrent);
  const auto queue_wait = std::chrono::duration<double>(o.queue_seconds);

  server.set_payload_max_length(4 * api.limits().max_body_bytes);  // beyond: 413 before reading it all
  server.set_read_timeout(5, 0);
  server.set_write_timeout(5, 0);
  server.set_keep_alive_max_count(1000);

  server.set_pre_routing_handler([loopback](const httplib::Request& request, httplib::Response& response) {
    if (loopback && !is_loopback_host(host_name(request.get_header_value("Host")))) {
      set_json(response, 403,
               error_json(fmt::format("Host '{}' is not this machine; open the explorer at 127.0.0.1 or localhost",
                                      request.get_header_value("Host"))));
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  server.set_post_routing_handler([](const httplib::Request&, httplib::Response& response) {
    response.set_header("X-Content-Type-Options", "nosniff");
    response.set_header("Cache-Control", "no-store");
    // The page may load nothing but its own files and talk to nothing but this server.
    response.set_header("Content-Security-Policy",
                        "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'");
  });

  for (const explorer::EmbeddedFile& file : explorer::kFiles) {
    const std::string path = std::string(file.path) == "/index.html" ? "/" : file.path;
    server.Get(path, [&file](const httplib::Request&, httplib::Response& response) {
      response.set_content(reinterpret_cast<const char*>(file.data), file.size, file.content_type);
    });
  }
  server.Get("/api/models", [&api](const httplib::Request&, httplib::Response& response) {
    const ApiResponse answer = api.models();
    set_json(response, answer.status, answer.body);
  });
  server.Post("/api/attention", [&](const httplib::Request& request, httplib::Response& response) {
    if (!slots.try_acquire_for(queue_wait)) {
      set_json(response, 503,
               error_json(fmt::format("busy: {} computations are running and none finished within {} s; try again",
                                      o.max_concurrent, o.queue_seconds)));
      return;
    }
    const ApiResponse answer = api.attention(request.body);  // never throws
    slots.release();
    set_json(response, answer.status, answer.body);
  });
  server.set_error_handler([](const httplib::Request& request, httplib::Response& response) {
    if (!response.body.empty()) return;
    const std::string message =
        response.status == 404   ? fmt::format("no such page or API: {} {}", request.method, request.path)
        : response.status == 413 ? "request body too large"
        : response.status == 405 ? fmt::format("{} is not allowed on {}", request.method, request.path)
                                 : fmt::format("HTTP {}", response.status);
    set_json(response, response.status, error_json(message));
  });
  server.set_exception_handler([](const httplib::Request&, httplib::Response& response, std::exception_ptr) {
    set_json(response, 500, error_json("internal error"));
  });

  catch_stop_signals();  // from here on, Ctrl-C stops the server cleanly
  const int port = o.port == 0 ? server.bind_to_any_port(o.host) : (server.bind_to_port(o.host, o.port) ? o.port : -1);
  if (port < 0) {
    throw Error(fmt::format("cannot listen on {}:{} (in use, or not an address of this machine); try --port 0 for "
                            "any free port",
                            o.host, o.port));
  }
  const std::string shown_host = o.host.find(':') != std::string::npos && !o.host.starts_with("[") ? "[" + o.host + "]" : o.host;
  fmt::print("qkv serve: the attention explorer is at http://{}:{}/  ({} model{}; Ctrl-C stops)\n", shown_host, port,
             api.loaded_models().size(), api.loaded_models().size() == 1 ? "" : "s");
  std::fflush(stdout);

  // Stops the server once a stop signal arrives (caught since before the URL was printed);
  // also ends when listening ends another way.
  std::atomic<bool> finished{false};
  std::thread stopper([&] {
    while (!finished) {
      // Once running: a stop() before listen_after_bind has started would be lost.
      if (g_stop_signal != 0 && server.is_running()) {
        server.stop();
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
  const bool listened = server.listen_after_bind();
  finished = true;
  stopper.join();
  const int received = g_stop_signal;
  if (received == 0 && !listened) throw Error(fmt::format("the server on {}:{} stopped unexpectedly", o.host, port));
  fmt::print("qkv serve: stopped ({})\n", received == SIGINT ? "Ctrl-C" : received == SIGTERM ? "SIGTERM" : "done");
  std::fflush(stdout);
}

}  // namespace

void add_serve_command(CLI::App& app) {
  auto options = std::make_shared<ServeOptions>();
  CLI::App* serve = app.add_subcommand(
      "serve", "Explore attention in the browser: a local page with heatmaps, temperature and masks");
  serve->add_option("--host", options->host,
                    "Address to listen on; the default keeps the explorer to this machine")
      ->capture_default_str();
  serve->add_option("--port", options->port, "Port to listen on; 0 picks a free one")->capture_default_str();
  serve->add_option("--model", options->models,
                    "A trained model's file (`qkv train --save`) the page may show; repeat for more");
  serve->add_option("--max-concurrent", options->max_concurrent, "Computations running at once; more requests wait")
      ->capture_default_str();
  serve->callback([options] { run_serve(*options); });
}

}  // namespace qkv::cli
