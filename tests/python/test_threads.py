"""Threads: one qkv.MultiHeadAttention (and one KV cache) called from 4 Python threads at once.

The bindings release the GIL, so the module's own lock (include/qkv/nn.hpp) is what keeps
training-mode calls from corrupting it. The threads run in a child interpreter: before that
lock, the heap was corrupted within seconds and the interpreter died, which a child's exit
status reports without taking pytest down with it.
"""
import os
import subprocess
import sys
import textwrap

import numpy as np

import qkv

THREADS_SCRIPT = textwrap.dedent("""
    import sys, threading, time
    import numpy as np
    import qkv

    module = qkv.MultiHeadAttention(64, 4, dropout=0.1, seed=1)  # training mode, dropout on
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 16, 64), dtype=np.float32)
    memory = rng.standard_normal((2, 24, 64), dtype=np.float32)
    failures, counts = [], [0, 0]  # [calls, backwards of another thread's forward]
    deadline = time.monotonic() + float(sys.argv[1])

    def work(t):
        try:
            i = 0
            while time.monotonic() < deadline and i < 400:
                cross = (t + i) % 2 == 1
                out, _ = module(x, memory, memory) if cross else module(x)
                assert out.shape == x.shape and np.isfinite(out).all()
                # The gradients of whichever forward came last, in its form: a tuple after a
                # cross-attention forward, one array after a self-attention one.
                grads = module.backward(out)
                dx = grads[0] if isinstance(grads, tuple) else grads
                assert dx.shape == x.shape and np.isfinite(dx).all(), (cross, dx.shape)
                counts[1] += isinstance(grads, tuple) != cross  # another thread's forward came last
                if i % 7 == t:
                    module.zero_grad()
                counts[0] += 1
                i += 1
        except BaseException as error:  # noqa: B902 - any failure is reported
            failures.append(repr(error))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    assert counts[0] >= 4, counts
    print("calls", counts[0], "crossed", counts[1])
""")


def test_training_module_shared_by_four_threads():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", THREADS_SCRIPT, "3"], capture_output=True, text=True, env=env,
                            timeout=120)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr[-3000:]}"
    assert "calls" in result.stdout


def test_eval_threads_agree_with_one_thread(rng):
    import threading

    module = qkv.MultiHeadAttention(32, 4, seed=2).eval()
    inputs = [rng.standard_normal((2, 5 + t, 32), dtype=np.float32) for t in range(4)]
    expected = [module(x)[0] for x in inputs]
    got = [None] * 4

    def work(t):
        got[t] = [module(inputs[t])[0] for _ in range(20)]

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for t in range(4):
        for out in got[t]:
            np.testing.assert_array_equal(out, expected[t])


def test_cache_shared_by_threads_takes_turns(rng):
    import threading

    module = qkv.MultiHeadAttention(32, 4, seed=3).eval()
    cache = module.make_cache(1, 64)
    token = rng.standard_normal((1, 1, 32), dtype=np.float32)

    def work():
        for _ in range(8):
            module(token, cache=cache)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert cache.length == 32  # every append landed, none lost or doubled
