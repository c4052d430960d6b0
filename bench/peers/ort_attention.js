// ONNX Runtime (onnxruntime-node, its prebuilt CPU library) timed on qkv's standard workloads,
// for bench/peers/run.py, which installs the npm package into its cache folder, writes the models
// (onnx_models.py) and a manifest, and runs:
//
//   NODE_PATH=<cache>/node/node_modules node bench/peers/ort_attention.js --threads 2 [--check] MANIFEST [WORKLOAD...]
//
// Per model: a session with intraOpNumThreads = --threads, one inter-op thread, sequential
// execution, all graph optimizations; inputs random (a fixed seed) or the manifest's int32
// values, created once. One warm-up, then runs until at least 10 and 0.2 s (3 when one takes
// over 1 s); the median, one JSON line per model:
//   {"peer": "ort", "version": "1.30.0", "workload": "W0", "variant": "GroupQueryAttention", "ms": 1.2, "runs": 10}
// --check adds "max_err": the largest difference from a float64 softmax(q k^T / sqrt(d) + mask) v
// on a few (batch, head, query) rows (attention models, whose q/k/v are (B, N, H*d)).
'use strict';

const fs = require('fs');
const ort = require('onnxruntime-node');

function parseArgs(argv) {
  const args = { threads: 2, check: false, manifest: null, only: [] };
  for (let i = 0; i < argv.length; ++i) {
    if (argv[i] === '--threads') args.threads = Number(argv[++i]);
    else if (argv[i] === '--check') args.check = true;
    else if (args.manifest === null) args.manifest = argv[i];
    else args.only.push(argv[i]);
  }
  if (args.manifest === null) {
    console.error('usage: node ort_attention.js [--threads N] [--check] MANIFEST [WORKLOAD...]');
    process.exit(2);
  }
  return args;
}

// A small deterministic generator (mulberry32) and Box-Muller normals.
function normals(count, seed) {
  let state = seed >>> 0;
  const uniform = () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
  const out = new Float32Array(count);
  for (let i = 0; i < count; i += 2) {
    const r = Math.sqrt(-2 * Math.log(uniform() + 1e-12)), a = 2 * Math.PI * uniform();
    out[i] = r * Math.cos(a);
    if (i + 1 < count) out[i + 1] = r * Math.sin(a);
  }
  return out;
}

function median(values) {
  const v = [...values].sort((a, b) => a - b), n = v.length;
  return n % 2 ? v[(n - 1) / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

async function timeMedian(call) {
  await call();
  const times = [];
  let spent = 0;
  for (;;) {
    const start = process.hrtime.bigint();
    await call();
    times.push(Number(process.hrtime.bigint() - start) / 1e6);
    spent += times[times.length - 1];
    const n = times.length;
    if ((times[0] > 1000 && n >= 3) || (n >= 10 && spent >= 200) || n >= 2000) break;
  }
  return [median(times), times.length];
}

// Largest |ORT - float64 reference| over a few rows; q/k/v/output are (B, N, H*d).
function checkAttention(c, q, k, v, out) {
  const { batch: B, q_heads: Hq, kv_heads: Hkv, q_len: Nq, kv_len: Nk, head_dim: d, causal } = c;
  const group = Hq / Hkv, scale = 1 / Math.sqrt(d);
  let worst = 0;
  for (const b of new Set([0, B - 1]))
    for (const h of new Set([0, Hq - 1]))
      for (const i of new Set([0, Math.floor(Nq / 2), Nq - 1])) {
        const visible = causal ? i + (Nk - Nq) + 1 : Nk, hk = Math.floor(h / group);
        const p = new Float64Array(visible);
        let top = -Infinity, sum = 0;
        for (let j = 0; j < visible; ++j) {
          let dot = 0;
          for (let c2 = 0; c2 < d; ++c2)
            dot += q[((b * Nq + i) * Hq + h) * d + c2] * k[((b * Nk + j) * Hkv + hk) * d + c2];
          p[j] = dot * scale;
          top = Math.max(top, p[j]);
        }
        for (let j = 0; j < visible; ++j) sum += (p[j] = Math.exp(p[j] - top));
        for (let c2 = 0; c2 < d; ++c2) {
          let o = 0;
          for (let j = 0; j < visible; ++j) o += p[j] * v[((b * Nk + j) * Hkv + hk) * d + c2];
          worst = Math.max(worst, Math.abs(o / sum - out[((b * Nq + i) * Hq + h) * d + c2]));
        }
      }
  return worst;
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const manifest = JSON.parse(fs.readFileSync(args.manifest, 'utf8'));
  const version = ort.env.versions ? ort.env.versions.node : 'unknown';
  const options = {
    executionProviders: ['cpu'],
    intraOpNumThreads: args.threads,
    interOpNumThreads: 1,
    executionMode: 'sequential',
    graphOptimizationLevel: 'all',
  };
  let seed = 1;
  for (const entry of manifest) {
    if (args.only.length && !args.only.includes(entry.workload)) continue;
    const line = { peer: 'ort', version, workload: entry.workload, variant: entry.variant };
    try {
      const session = await ort.InferenceSession.create(entry.path, options);
      const feeds = {};
      for (const f of entry.feeds) {
        const count = f.dims.reduce((a, b) => a * b, 1);
        feeds[f.name] = f.int32
          ? new ort.Tensor('int32', Int32Array.from(f.int32), f.dims)
          : new ort.Tensor('float32', normals(count, seed++), f.dims);
      }
      const fetches = [session.outputNames[0]];
      const [ms, runs] = await timeMedian(() => session.run(feeds, fetches));
      line.ms = ms;
      line.runs = runs;
      if (args.check && entry.check) {
        const out = (await session.run(feeds, fetches))[session.outputNames[0]].data;
        line.max_err = checkAttention(entry.check, feeds.query.data, feeds.key.data, feeds.value.data, out);
      }
      if (session.release) await session.release();
    } catch (error) {
      line.error = String(error && error.message ? error.message : error).split('\n')[0];
    }
    console.log(JSON.stringify(line));
  }
}

main().catch((error) => {
  console.error(`ort_attention: ${error && error.stack ? error.stack : error}`);
  process.exit(1);
});
