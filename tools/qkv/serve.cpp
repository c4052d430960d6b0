// `qkv serve`: the attention explorer, one page and a JSON API on a local HTTP server.
//
//   qkv serve                                  # http://127.0.0.1:8080/
//   qkv serve --port 0                         # any free port; the URL printed says which
//   qkv serve --model copy.qkv --model recall.qkv
//   qkv serve --model ~/models/gpt2 --model ~/models/bert-base-uncased   # Hugging Face folders
//
// The page (tools/qkv/explorer/, embedded in the binary at build time) asks POST /api/attention
// for weights and draws them; the API's requests and answers are in serve_api.hpp. Safety:
// loopback unless --host names another address (then a warning); only requests whose Host header
// is on an exact list (serve_hosts.hpp: the --host address, localhost, 127.0.0.1, [::1] and
// --allow-host names), so a web page elsewhere cannot use a browser to reach the explorer by DNS
// rebinding; body and text limits; models only from the files named here; at most
// --max-concurrent computations at once (others wait, then get 503); connections that slow or
// idle clients cannot use up (serve_connections.hpp); and Ctrl-C (SIGINT) or SIGTERM stops it
// cleanly.
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <functional>
#include <memory>
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
#include "serve_overview.hpp"
#include "serve_connections.hpp"
#include "serve_hosts.hpp"
#include "serve_slots.hpp"

namespace qkv::cli {
namespace {

struct ServeOptions {
  std::string host = "127.0.0.1";
  int port = 8080;
  std::vector<std::string> models;
  std::vector<std::string> allowed_hosts;  // --allow-host: more names the Host header may give
  int max_concurrent = 4;
  double queue_seconds = 10;  // how long a request waits for a computation slot before a 503
};

// The most computations --max-concurrent may allow.
constexpr int kMaxConcurrentLimit = 64;

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

void check_options(const ServeOptions& o) {
  if (o.max_concurrent < 1 || o.max_concurrent > kMaxConcurrentLimit) {
    throw Error(fmt::format("--max-concurrent must be between 1 and {}, got {}", kMaxConcurrentLimit, o.max_concurrent));
  }
  if (o.port < 0 || o.port > 65535) throw Error(fmt::format("--port must be between 0 and 65535, got {}", o.port));
  (void)HostAllowList(o.host, o.port, o.allowed_hosts);  // --host and --allow-host, before any work
  if (!is_loopback_host(o.host)) {
    // On every address (0.0.0.0, ::) no one address is the name clients use: --allow-host gives it.
    const bool any = o.host == "0.0.0.0" || o.host == "::";
    fmt::print(stderr,
               "qkv serve: warning: listening on {}, not loopback: anyone who can reach this machine on that "
               "address can use the explorer. Leave out --host to keep it to this machine (127.0.0.1). Requests "
               "must name {} in their Host header.\n",
               o.host, any ? "this machine by an --allow-host NAME (its address or name on the network)"
                           : fmt::format("{} or an --allow-host NAME", url_host(o.host)));
  }
}

// Refuses, before any route, a request whose Host header is not on the list (DNS rebinding).
// Set once bound (the list names the port), before the server reads any request.
void guard_hosts(httplib::Server& server, const std::shared_ptr<const HostAllowList>& hosts) {
  server.set_pre_routing_handler([hosts](const httplib::Request& request, httplib::Response& response) {
    const std::string host = request.get_header_value("Host");
    if (hosts->allows(host)) return httplib::Server::HandlerResponse::Unhandled;
    set_json(response, 403,
             error_json(fmt::format("Host '{}' is not a name of this server ({}); open the explorer at one of "
                                    "those, or start it with --allow-host NAME",
                                    escaped_text(host), hosts->shown())));
    return httplib::Server::HandlerResponse::Handled;
  });
}

void add_headers_and_errors(httplib::Server& server) {
  server.set_post_routing_handler([](const httplib::Request&, httplib::Response& response) {
    response.set_header("X-Content-Type-Options", "nosniff");
    response.set_header("Cache-Control", "no-store");
    // The page may load nothing but its own files and talk to nothing but this server.
    response.set_header("Content-Security-Policy",
                        "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'");
  });
  server.set_error_handler([](const httplib::Request& request, httplib::Response& response) {
    if (!response.body.empty()) return;
    const std::string message =
        response.status == 404   ? fmt::format("no such page or API: {} {}", request.method, escaped_text(request.path))
        : response.status == 413 ? "request body too large"
        : response.status == 405 ? fmt::format("{} is not allowed on {}", request.method, escaped_text(request.path))
                                 : fmt::format("HTTP {}", response.status);
    set_json(response, response.status, error_json(message));
  });
  server.set_exception_handler([](const httplib::Request&, httplib::Response& response, std::exception_ptr) {
    set_json(response, 500, error_json("internal error"));
  });
}

// Computations wait in line for one of --max-concurrent slots, up to queue_seconds, then 503.
struct Slots {
  FairSlots free;
  int count;
  double wait_seconds;
};

void add_routes(httplib::Server& server, const ExplorerApi& api, Slots& slots) {
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
  // Each computation in one of the slots; `compute` never throws.
  const auto computed = [&slots](const std::function<ApiResponse(const std::string&)>& compute) {
    return [&slots, compute](const httplib::Request& request, httplib::Response& response) {
      if (!slots.free.acquire_for(std::chrono::duration<double>(slots.wait_seconds))) {
        set_json(response, 503,
                 error_json(fmt::format("busy: {} computations are running and none finished within {} s; try again",
                                        slots.count, slots.wait_seconds)));
        return;
      }
      const ApiResponse answer = compute(request.body);
      slots.free.release();
      set_json(response, answer.status, answer.body);
    };
  };
  server.Post("/api/attention", computed([&api](const std::string& body) { return api.attention(body); }));
  server.Post("/api/overview", computed([&api](const std::string& body) { return attention_overview(api, body); }));
}

// Binds --host:--port (any free port for 0) and returns the port; qkv::Error if it cannot.
int bind(httplib::Server& server, const ServeOptions& o, const ServerConnections& connections) {
  const int port = o.port == 0 ? server.bind_to_any_port(o.host) : (server.bind_to_port(o.host, o.port) ? o.port : -1);
  if (port < 0) {
    throw Error(fmt::format("cannot listen on {}:{} (in use, or not an address of this machine); try --port 0 for "
                            "any free port",
                            o.host, o.port));
  }
  connections.listen_with_backlog();
  return port;
}

// Serves until a stop signal (caught since before the URL was printed) or listening ends
// another way; returns the signal, 0 for none.
int serve_until_stopped(httplib::Server& server, const std::string& where) {
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
  if (received == 0 && !listened) throw Error(fmt::format("the server on {} stopped unexpectedly", where));
  return received;
}

void run_serve(const ServeOptions& o) {
  check_options(o);
  const ExplorerApi api(o.models, ServeLimits{});
  httplib::Server server;
  const ServerConnections connections(server, ConnectionLimits{});
  server.set_payload_max_length(4 * api.limits().max_body_bytes);  // beyond: 413 before reading it all
  server.set_write_timeout(5, 0);
  Slots slots{FairSlots(o.max_concurrent), o.max_concurrent, o.queue_seconds};
  add_headers_and_errors(server);
  add_routes(server, api, slots);

  catch_stop_signals();  // from here on, Ctrl-C stops the server cleanly
  const int port = bind(server, o, connections);
  guard_hosts(server, std::make_shared<const HostAllowList>(o.host, port, o.allowed_hosts));
  fmt::print("qkv serve: the attention explorer is at http://{}:{}/  ({} model{}; Ctrl-C stops)\n", url_host(o.host),
             port, api.model_count(), api.model_count() == 1 ? "" : "s");
  std::fflush(stdout);
  const int received = serve_until_stopped(server, fmt::format("{}:{}", url_host(o.host), port));
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
                    "A trained model's file (`qkv train --save`) or a Hugging Face model folder (config.json, "
                    "safetensors, tokenizer) the page may show; repeat for more");
  serve->add_option("--allow-host", options->allowed_hosts,
                    "Another name the browser may use for this server (its Host header), e.g. my-laptop.local; "
                    "repeat for more. Besides these: the --host address, localhost, 127.0.0.1 and [::1]");
  serve->add_option("--max-concurrent", options->max_concurrent, "Computations running at once; more requests wait")
      ->capture_default_str();
  serve->callback([options] { run_serve(*options); });
}

}  // namespace qkv::cli
