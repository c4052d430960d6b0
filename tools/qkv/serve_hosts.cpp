// The Host allow-list of `qkv serve`; see serve_hosts.hpp.
#include "serve_hosts.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <cctype>

#include <fmt/core.h>

#include "qkv/error.hpp"

namespace qkv::cli {
namespace {

std::string lower(std::string text) {
  for (char& c : text) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return text;
}

// A host name (letters, digits, '-' and '.'), an IPv4 address or an IPv6 address, bare or in
// brackets: what --allow-host takes. No port, no user, no path, no spaces.
bool is_host_name(const std::string& name) {
  const bool bracketed = name.size() > 2 && name.front() == '[' && name.back() == ']';
  const std::string bare = bracketed ? name.substr(1, name.size() - 2) : name;
  in6_addr address{};
  if (inet_pton(AF_INET6, bare.c_str(), &address) == 1) return true;
  if (bare != name || name.empty() || name.size() > 253) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.';
  });
}

}  // namespace

bool is_loopback_host(const std::string& host) {
  if (lower(host) == "localhost") return true;
  const bool bracketed = host.size() > 2 && host.front() == '[' && host.back() == ']';
  const std::string bare = bracketed ? host.substr(1, host.size() - 2) : host;
  in_addr v4{};
  if (!bracketed && inet_pton(AF_INET, bare.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (inet_pton(AF_INET6, bare.c_str(), &v6) != 1) return false;
  if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
  return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
}

std::string url_host(const std::string& host) {
  return host.find(':') != std::string::npos && !host.starts_with("[") ? "[" + host + "]" : host;
}

HostAllowList::HostAllowList(const std::string& bound_host, int port, const std::vector<std::string>& extra) {
  if (bound_host.empty()) {
    throw Error("--host is empty: give the address to listen on, e.g. 127.0.0.1 (the default) or ::1");
  }
  if (!is_host_name(bound_host)) {
    throw Error(fmt::format("--host '{}' is not a host name or an address (no port or scheme: use --port)", bound_host));
  }
  std::vector<std::string> names = {lower(url_host(bound_host)), "localhost", "127.0.0.1", "[::1]"};
  for (const std::string& name : extra) {
    if (!is_host_name(name)) {
      throw Error(fmt::format("--allow-host '{}' is not a host name or an address; give one without a port, such as "
                              "my-laptop.local or 192.168.1.10",
                              name));
    }
    names.push_back(lower(url_host(name)));
  }
  for (const std::string& name : names) {
    if (std::find(names_.begin(), names_.end(), name) != names_.end()) continue;
    names_.push_back(name);
    accepted_.insert(name);
    accepted_.insert(fmt::format("{}:{}", name, port));
  }
}

bool HostAllowList::allows(const std::string& host_header) const { return accepted_.contains(lower(host_header)); }

std::string HostAllowList::shown() const {
  std::string text;
  for (const std::string& name : names_) text += (text.empty() ? "" : ", ") + name;
  return text;
}

}  // namespace qkv::cli
