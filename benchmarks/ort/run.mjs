// Runs one ONNX graph on onnxruntime-node's CPU runtime for benchmarks/ort_peer.py, which writes the graphs
// and the inputs, checks the output and reads what this prints.
//
//   node run.mjs --model M.onnx --input X.bin --dims 1,L,512 --threads N --output Y.bin
//                [--profile PREFIX] [--optimized OPT.onnx] [--then-time 1]
//   node run.mjs --probe 1        prints {ort_version, node_version}
//
// X.bin holds the float32 input (little-endian, row-major, of shape --dims) of the graph's one input.
// The InferenceSession: CPU execution provider, intraOpNumThreads = N, interOpNumThreads = 1,
// graphOptimizationLevel 'all', executionMode 'sequential'; --profile turns ORT's profiler on
// (profileFilePrefix = PREFIX) and --optimized writes the optimised graph ORT runs.
//
// 1. The check run: one run, its output written to Y.bin, the profiler ended (it covers the InferenceSession's
//    creation and this run only); prints one JSON line
//      {ort_version, node_version, inputs, outputs, output_dims, session_ms, first_run_ms, profile_file}.
// 2. With --then-time 1 it then reads commands from stdin, one a line: "time R" runs the graph R times,
//    measuring the wall clock (process.hrtime) around each `await session.run(feeds)` and the process's
//    CPU time over the R runs, and prints {runs_ms: [...], cpu_per_wall}; ort_peer.py sends several, one
//    per round, between which it times c2f. "stop" or the end of stdin ends it (ort_peer.py says "stop"
//    at once when the check failed).
// Exit code 0 on success, 2 when onnxruntime-node is not installed (npm ci --ignore-scripts in this
// folder), 1 otherwise.

import fs from 'node:fs';
import path from 'node:path';
import readline from 'node:readline';
import { fileURLToPath } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));

function parseArgs(argv) {
  const args = { 'then-time': '0' };
  for (let i = 0; i < argv.length; i += 2) {
    const key = argv[i];
    if (!key.startsWith('--') || i + 1 >= argv.length) {
      throw new Error(`expected --name value pairs, got ${JSON.stringify(argv.slice(i))}`);
    }
    args[key.slice(2)] = argv[i + 1];
  }
  return args;
}

function count(name, text, least) {
  const n = Number(text);
  if (!Number.isInteger(n) || n < least) throw new Error(`--${name} must be an integer >= ${least}, got ${text}`);
  return n;
}

function readFloats(file, dims) {
  const bytes = fs.readFileSync(file);
  const n = dims.reduce((a, b) => a * b, 1);
  if (bytes.byteLength !== 4 * n) {
    throw new Error(`${file}: ${bytes.byteLength} bytes, expected ${4 * n} for dims [${dims}]`);
  }
  // A copy into an ArrayBuffer of its own: a Buffer's offset need not be a multiple of 4.
  const data = new Float32Array(n);
  new Uint8Array(data.buffer).set(bytes);
  return data;
}

function newestProfile(prefix) {
  // onnxruntime-node's endProfiling() writes PREFIX_<date>.json and does not return the name.
  const dir = path.dirname(path.resolve(prefix));
  const base = path.basename(prefix);
  const found = fs.readdirSync(dir).filter((f) => f.startsWith(base) && f.endsWith('.json'))
    .map((f) => path.join(dir, f)).sort((a, b) => fs.statSync(b).mtimeMs - fs.statSync(a).mtimeMs);
  return found.length ? found[0] : null;
}

async function main() {
  let ort;
  try {
    ort = (await import('onnxruntime-node')).default;
  } catch (e) {
    process.stderr.write(`run.mjs: cannot load onnxruntime-node (${e.message}); run 'npm ci --ignore-scripts' ` +
                         `in ${here}\n`);
    process.exit(2);
  }
  const versions = { ort_version: ort.env.versions.node ?? ort.env.versions.common, node_version: process.version };
  const args = parseArgs(process.argv.slice(2));
  if (args.probe !== undefined) {
    process.stdout.write(JSON.stringify(versions) + '\n');
    return;
  }
  for (const need of ['model', 'input', 'dims', 'threads', 'output']) {
    if (args[need] === undefined) throw new Error(`--${need} is required`);
  }
  const threads = count('threads', args.threads, 1);
  const thenTime = count('then-time', args['then-time'], 0) > 0;
  const dims = args.dims.split(',').map((d) => count('dims', d, 0));

  const options = {
    executionProviders: ['cpu'],
    intraOpNumThreads: threads,
    interOpNumThreads: 1,
    graphOptimizationLevel: 'all',
    executionMode: 'sequential',
    logSeverityLevel: 3,
  };
  if (args.profile !== undefined) {
    options.enableProfiling = true;
    options.profileFilePrefix = args.profile;
  }
  if (args.optimized !== undefined) options.optimizedModelFilePath = args.optimized;
  const t0 = process.hrtime.bigint();
  const session = await ort.InferenceSession.create(args.model, options);
  const sessionMs = Number(process.hrtime.bigint() - t0) / 1e6;
  if (session.inputNames.length !== 1) {
    throw new Error(`${args.model}: expected one input, the graph has ${session.inputNames.length}`);
  }
  const feeds = { [session.inputNames[0]]: new ort.Tensor('float32', readFloats(args.input, dims), dims) };
  const outputName = session.outputNames[0];

  // 1. The check run (also the warm-up).
  const s = process.hrtime.bigint();
  const y = (await session.run(feeds))[outputName];
  const firstMs = Number(process.hrtime.bigint() - s) / 1e6;
  if (y.type !== 'float32') throw new Error(`${args.model}: output ${outputName} is ${y.type}, expected float32`);
  fs.writeFileSync(args.output, new Uint8Array(y.data.buffer, y.data.byteOffset, y.data.byteLength));
  let profileFile = null;
  if (args.profile !== undefined) {
    session.endProfiling();
    profileFile = newestProfile(args.profile);
  }
  process.stdout.write(JSON.stringify({
    ...versions, inputs: session.inputNames, outputs: session.outputNames, output_dims: y.dims,
    session_ms: sessionMs, first_run_ms: firstMs, profile_file: profileFile,
  }) + '\n');

  // 2. The timed runs, once ort_peer.py has checked the output.
  if (thenTime) {
    const rl = readline.createInterface({ input: process.stdin });
    for await (const line of rl) {
      const command = line.trim().split(/\s+/);
      if (command[0] !== 'time') break;
      const reps = count('time', command[1], 1);
      const runsMs = [];
      const cpu0 = process.cpuUsage();
      for (let i = 0; i < reps; ++i) {
        const r = process.hrtime.bigint();
        await session.run(feeds);
        runsMs.push(Number(process.hrtime.bigint() - r) / 1e6);
      }
      const cpu = process.cpuUsage(cpu0);
      const wall = runsMs.reduce((a, b) => a + b, 0);
      process.stdout.write(JSON.stringify({ runs_ms: runsMs, cpu_per_wall: (cpu.user + cpu.system) / 1e3 / wall }) +
                           '\n');
    }
    rl.close();
  }
  await session.release();
}

main().catch((e) => {
  process.stderr.write(`run.mjs: ${e.stack || e}\n`);
  process.exit(1);
});
