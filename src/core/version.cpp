#include "qkv/qkv.hpp"

namespace qkv {
const char* version() { return QKV_VERSION_STRING; }
}  // namespace qkv
