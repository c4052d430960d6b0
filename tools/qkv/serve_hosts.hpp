// Which Host headers `qkv serve` answers. A web page elsewhere can point its own name at
// 127.0.0.1 (DNS rebinding) and have a visitor's browser talk to the explorer; the browser then
// sends that page's name in Host. So the server answers only an exact list of names (each alone
// or with the server's port) and refuses every other Host with 403: prefixes, suffixes and
// look-alikes such as "127.attacker.example" or "127.0.0.1.evil" are not on it.
#pragma once

#include <set>
#include <string>
#include <vector>

namespace qkv::cli {

// True for the addresses only this machine can reach: "localhost", an IPv4 address in
// 127.0.0.0/8 written in full (127.0.0.1) and ::1 (bare or in brackets, or as ::ffff:127.x.y.z).
bool is_loopback_host(const std::string& host);

class HostAllowList {
 public:
  // bound_host: the --host the server listens on ("" is refused); port: the port it listens on;
  // extra: the --allow-host names, each a host name or address without a port. Throws
  // qkv::Error naming the option and the value on an empty or malformed name.
  HostAllowList(const std::string& bound_host, int port, const std::vector<std::string>& extra);

  // True when the Host header is one of the names, alone or followed by ":<port>". Names compare
  // without regard to case (DNS names do not have one); nothing else is trimmed or guessed.
  bool allows(const std::string& host_header) const;

  // The names, as a message lists them: "127.0.0.1, localhost, [::1]".
  std::string shown() const;

 private:
  std::vector<std::string> names_;  // lower case, IPv6 addresses in brackets
  std::set<std::string> accepted_;  // every name alone and with ":<port>"
};

// An address as it appears in a URL or a Host header: an IPv6 address in brackets, anything
// else as it is ("::1" -> "[::1]", "127.0.0.1" -> "127.0.0.1").
std::string url_host(const std::string& host);

}  // namespace qkv::cli
