// Linked into every program of the ASan + UBSan build (CMakeLists.txt, QKV_SANITIZE), the tests
// and the qkv tool alike: LeakSanitizer's suppressions for the runtimes they load that keep memory
// until exit by design. Only those libraries' allocations are excused: a leak of ours still fails.
//   - libfontconfig: cairo asks it for fonts; it keeps its caches (every drawing program);
//   - libomp: clang's OpenMP runtime keeps the thread descriptors of a team larger than the last
//     (a 70-worker for_each_item, say) in its pool.
// A definition in the program itself, not in libqkv.so: the sanitizer runtime's weak default
// would come first in the symbol lookup (clang links that runtime into the program).
extern "C" const char* __lsan_default_suppressions() { return "leak:libfontconfig.so\nleak:libomp.so\n"; }
