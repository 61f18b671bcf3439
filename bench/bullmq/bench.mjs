// BullMQ counterpart of the sluicegate benchmarks (issue 4).
//
//   REDIS_URL=redis://127.0.0.1:PORT node bench.mjs [scenario...]
//
// Prints one JSON object per line on stdout per result (progress goes to stderr).
// Redis CPU and command counts are deltas of INFO cpu / INFO commandstats over the
// measured phase, so the server must not be busy with anything else meanwhile.
// Command counts include commands run inside Lua scripts (Redis counts those too).

import { Queue, Worker, FlowProducer, QueueEvents } from 'bullmq';
import { Redis } from 'ioredis';
import { createRequire } from 'node:module';
import { performance } from 'node:perf_hooks';
import { setTimeout as sleep } from 'node:timers/promises';
import os from 'node:os';
import { on } from 'node:events';
import { Worker as Thread } from 'node:worker_threads';

const REDIS_URL = process.env.REDIS_URL;
if (!REDIS_URL) {
  // No default on purpose: this writes a million keys and burns CPU; never hit a server by accident.
  console.error('bench.mjs: REDIS_URL is required (e.g. REDIS_URL=redis://127.0.0.1:6633)');
  process.exit(2);
}
const SCALE = Number(process.env.BENCH_SCALE ?? 1);
if (!(SCALE > 0)) {
  console.error(`bench.mjs: bad BENCH_SCALE ${process.env.BENCH_SCALE}`);
  process.exit(2);
}
const TIMEOUT_MS = Number(process.env.BENCH_TIMEOUT_S ?? 240) * 1000;
const scaled = (x) => Math.max(1, Math.round(x * SCALE));

const CONCURRENCY = 16;
const BATCH = 1000; // addBulk batch size, as in the figures quoted in issue 4
const PAYLOAD = { p: '0123456789abcdef' }; // 16-byte payload everywhere
// Unique per run, so concurrent or crashed runs never mix keys; everything lives under it.
const PREFIX = `sgbench-${Date.now().toString(36)}-${process.pid}`;
const connection = { url: REDIS_URL, maxRetriesPerRequest: null }; // null: required by Worker

const now = () => performance.now();
const log = (...a) => console.error(`[${(now() / 1000).toFixed(1)}s]`, ...a);
const r = (x, d) => (x == null || !Number.isFinite(x) ? null : Number(x.toFixed(d)));

// ---------------------------------------------------------------------------- Redis stats
// Gives up after a few reconnects, so a wrong REDIS_URL fails fast instead of hanging.
const stats = new Redis(REDIS_URL, { maxRetriesPerRequest: 3, retryStrategy: (n) => (n > 3 ? null : 200) });
stats.on('error', (e) => log(`redis: ${e.message}`));

function infoFields(text) {
  const m = new Map();
  for (const line of text.split('\r\n')) {
    const i = line.indexOf(':');
    if (i > 0) m.set(line.slice(0, i), line.slice(i + 1));
  }
  return m;
}

async function snapshot() {
  const cpu = infoFields(await stats.info('cpu'));
  const cs = infoFields(await stats.info('commandstats'));
  let calls = 0;
  let scripts = 0;
  for (const [k, v] of cs) {
    const n = Number(/calls=(\d+)/.exec(v)?.[1] ?? 0);
    calls += n;
    if (/^cmdstat_(evalsha|eval|fcall)$/.test(k)) scripts += n;
  }
  const mem = infoFields(await stats.info('memory'));
  return {
    cpu: Number(cpu.get('used_cpu_sys')) + Number(cpu.get('used_cpu_user')),
    calls,
    scripts,
    mem: Number(mem.get('used_memory')),
  };
}

// Per-item Redis cost between two snapshots.
function cost(s0, s1, items) {
  return {
    cpu: ((s1.cpu - s0.cpu) * 1e6) / items,
    cmds: (s1.calls - s0.calls) / items,
    scripts: (s1.scripts - s0.scripts) / items,
  };
}

function emit(scenario, { items, tput = null, p50 = null, p99 = null, c = null, bytes = null, note = '' }) {
  const scr = c ? `; ${r(c.scripts, 2)} script calls/item` : '';
  console.log(
    JSON.stringify({
      system: 'bullmq',
      scenario,
      items,
      throughput_per_s: r(tput, 1),
      p50_ms: r(p50, 3),
      p99_ms: r(p99, 3),
      redis_cpu_us_per_item: c ? r(c.cpu, 2) : null,
      redis_cmds_per_item: c ? r(c.cmds, 2) : null,
      bytes_per_item: r(bytes, 1),
      note: note + scr,
    }),
  );
}

function percentiles(xs) {
  const s = [...xs].sort((a, b) => a - b);
  const at = (p) => (s.length ? s[Math.min(s.length - 1, Math.max(0, Math.ceil(p * s.length) - 1))] : null);
  return { p50: at(0.5), p99: at(0.99) };
}

function deferred() {
  let resolve, reject;
  const promise = new Promise((a, b) => ((resolve = a), (reject = b)));
  return { promise, resolve, reject };
}

// ---------------------------------------------------------------------------- per-scenario resources
// Every BullMQ object a scenario opens is registered here, so a failed or timed-out scenario
// still closes its connections and obliterates its queues before the next one starts.
class Ctx {
  constructor() {
    this.workers = [];
    this.others = [];
    this.queues = new Map();
    this.failure = deferred(); // rejected by worker/queue 'error' events
  }
  queue(name) {
    if (!this.queues.has(name)) {
      const q = new Queue(name, { connection, prefix: PREFIX });
      q.on('error', (e) => this.failure.reject(e));
      this.queues.set(name, q);
    }
    return this.queues.get(name);
  }
  worker(name, fn, opts = {}) {
    this.queue(name); // so cleanup obliterates it
    const w = new Worker(name, fn, { connection, prefix: PREFIX, concurrency: CONCURRENCY, ...opts });
    w.on('error', (e) => this.failure.reject(e));
    w.on('failed', (job, e) => this.failure.reject(e));
    this.workers.push(w);
    return w;
  }
  flowProducer() {
    const f = new FlowProducer({ connection, prefix: PREFIX });
    f.on('error', (e) => this.failure.reject(e));
    this.others.push(f);
    return f;
  }
  events(name) {
    const e = new QueueEvents(name, { connection, prefix: PREFIX });
    e.on('error', (err) => this.failure.reject(err));
    this.others.push(e);
    return e;
  }
  async cleanup() {
    await Promise.allSettled(this.workers.map((w) => w.close(true)));
    await Promise.allSettled(this.others.map((o) => o.close()));
    for (const q of this.queues.values()) {
      // Larger count than the default 1000: fewer round trips for the 1M-job queue.
      await q.obliterate({ force: true, count: 10000 }).catch((e) => log('obliterate failed:', e.message));
      await q.close().catch(() => {});
    }
  }
}

// Resolves when `target` worker completions matching `pred` were seen; records the last time.
function completionCounter(worker, target, pred = () => true) {
  const d = deferred();
  let seen = 0;
  worker.on('completed', (job) => {
    if (pred(job) && ++seen === target) d.resolve(now());
  });
  return d.promise;
}

// Runs a built (not yet running) Worker until `target` of its jobs matching `pred` completed:
// the snapshots before its start and after the last completion, and the time between, in ms.
async function drain(ctx, w, target, pred = () => true) {
  const done = completionCounter(w, target, pred);
  await w.waitUntilReady();
  const before = await snapshot();
  const t0 = now();
  w.run().catch((e) => ctx.failure.reject(e));
  const ms = (await done) - t0;
  return { before, after: await snapshot(), ms };
}

// Worst PING round trip while `phase` runs, i.e. how long Redis was blocked for other clients
// (a MULTI/EXEC runs all its commands atomically). The prober runs in its own thread with its
// own connection, so a busy event loop here (building a big flow) does not inflate it.
const PROBE = `
const { parentPort, workerData } = require('node:worker_threads');
const { Redis } = require(workerData.ioredis);
const r = new Redis(workerData.url);
let stop = false;
parentPort.once('message', () => (stop = true));
(async () => {
  const samples = [];
  parentPort.postMessage('ready');
  while (!stop) {
    const t = performance.now();
    await r.ping();
    samples.push(performance.now() - t);
    await new Promise((res) => setTimeout(res, workerData.everyMs));
  }
  r.disconnect();
  parentPort.postMessage(samples);
})();`;

// The PING round trips (ms) of the prober, one every `everyMs`, while `phase` runs.
async function pings(phase, everyMs) {
  const ioredis = createRequire(import.meta.url).resolve('ioredis');
  const th = new Thread(PROBE, { eval: true, workerData: { url: REDIS_URL, ioredis, everyMs } });
  const msgs = on(th, 'message');
  await msgs.next(); // 'ready'
  try {
    await phase();
  } finally {
    th.postMessage('stop');
  }
  const samples = (await msgs.next()).value[0];
  await th.terminate();
  return samples;
}

async function worstPing(phase) {
  return Math.max(0, ...(await pings(phase, 50)));
}

async function addBulk(q, total, opts, name = 'j') {
  for (let i = 0; i < total; i += BATCH) {
    const jobs = [];
    for (let j = i; j < Math.min(total, i + BATCH); j++) jobs.push({ name, data: PAYLOAD, opts });
    await q.addBulk(jobs);
  }
}

// N plain jobs queued with addBulk, then drained by one Worker; `discard` sets removeOnComplete.
// Rows: `<name>_add` (bytes: Redis memory per queued job) and `<name>_queue` (bytes: what is
// still held per job once all completed, i.e. the results kept).
async function plainQueue(ctx, name, N, discard) {
  const scenario = discard ? 'plain_queue' : 'plain_queue_kept';
  const addRow = discard ? 'plain_add' : 'plain_add_kept';
  const q = ctx.queue(name);
  await q.waitUntilReady();
  const s0 = await snapshot();
  const t0 = now();
  await addBulk(q, N, discard ? { removeOnComplete: true } : {});
  const t1 = now();
  const s1 = await snapshot();
  emit(addRow, {
    items: N,
    tput: N / ((t1 - t0) / 1000),
    c: cost(s0, s1, N),
    bytes: (s1.mem - s0.mem) / N,
    note: `addBulk batches of ${BATCH}; bytes: Redis memory per queued job`,
  });

  const run = await drain(ctx, ctx.worker(name, async () => {}, { autorun: false }), N);
  emit(scenario, {
    items: N,
    tput: N / (run.ms / 1000),
    c: cost(run.before, run.after, N),
    bytes: (run.after.mem - s0.mem) / N,
    note:
      `1 Worker, concurrency ${CONCURRENCY}, no-op; ${discard ? 'removeOnComplete' : 'results kept'}; ` +
      'worker start -> last completion; bytes: results kept per job',
  });
}

// `plain_queue` with the parts packed by hand, as sluicegate's `many_small_packed` packs them with
// `chunks`: N parts as jobs of up to `size` parts each (the job's data their payloads), drained by
// one Worker whose processor runs a no-op per part and returns their outputs; results discarded.
// The row counts parts, as sluicegate's does.
async function chunkedQueue(ctx, N, size) {
  const q = ctx.queue('chunked');
  await q.waitUntilReady();
  const jobs = [];
  for (let i = 0; i < N; i += size) {
    jobs.push({ name: 'c', data: Array(Math.min(size, N - i)).fill(PAYLOAD), opts: { removeOnComplete: true } });
  }
  for (let i = 0; i < jobs.length; i += BATCH) await q.addBulk(jobs.slice(i, i + BATCH));
  const part = async () => null;
  const w = ctx.worker('chunked', async (job) => {
    const out = [];
    for (const p of job.data) out.push(await part(p));
    return out;
  }, { autorun: false });
  const run = await drain(ctx, w, jobs.length);
  emit('plain_queue_chunked', {
    items: N,
    tput: N / (run.ms / 1000),
    c: cost(run.before, run.after, N),
    bytes: null,
    note: `${jobs.length} jobs of up to ${size} parts each; 1 Worker, concurrency ${CONCURRENCY}, no-op per part; removeOnComplete; items are parts`,
  });
}

// ---------------------------------------------------------------------------- scenarios
const scenarios = {
  // Results discarded (removeOnComplete), as BullMQ users run a plain queue most often.
  async plain_queue(ctx) {
    await plainQueue(ctx, 'plain', scaled(100_000), true);
  },

  // Parts packed six to a job, as sluicegate's `many_small_packed` packs them.
  async plain_queue_chunked(ctx) {
    await chunkedQueue(ctx, scaled(100_000), 6);
  },

  // Results kept: each completed job stays in Redis with its return value.
  async plain_queue_kept(ctx) {
    await plainQueue(ctx, 'plain_kept', scaled(100_000), false);
  },

  async flow_small(ctx) {
    const P = scaled(1000);
    const C = 100;
    await runFlows(ctx, 'flow_small', P, C, 10); // 10 flows (1,010 jobs) per addBulk call
  },

  async flow_huge(ctx) {
    // One FlowProducer.add with all children: BullMQ sends the whole flow as one MULTI.
    await runFlows(ctx, 'flow_huge', 1, scaled(200_000), 1);
  },

  async idle_latency(ctx) {
    const N = scaled(1000);
    const q = ctx.queue('idle');
    const qe = ctx.events('idle');
    const ends = new Map();
    let starts = [];
    const w = ctx.worker('idle', async (job) => {
      starts.push(now() - job.data.t0);
      ends.set(job.id, now()); // last thing before the processor returns
    });
    await Promise.all([q.waitUntilReady(), qe.waitUntilReady(), w.waitUntilReady()]);
    // No removeOnComplete here: waitUntilFinished treats a job removed before it looks as failed.
    const wholes = [];
    const once = async () => {
      const t0 = now();
      const job = await q.add('j', { ...PAYLOAD, t0 });
      await job.waitUntilFinished(qe, 10_000);
      const t1 = now();
      wholes.push(t1 - t0);
      return t1 - ends.get(job.id);
    };
    // Warm-up: script loading, and V8's JIT. With 20 rounds, run alone (`node bench.mjs
    // idle_latency`), p50 was 0.29-0.34 ms and p99 3.4-4.0 against 0.25 and 1.0-1.7 after 2,000
    // (AMD EPYC host, 2026-11-30). sluicegate's idle_latency warms up as many rounds.
    for (let i = 0; i < scaled(2000); i++) await once();
    await sleep(200);
    starts = [];
    wholes.length = 0;
    const completions = [];
    const s0 = await snapshot();
    for (let i = 0; i < N; i++) completions.push(await once());
    const s1 = await snapshot();
    const a = percentiles(starts);
    emit('idle_latency', {
      items: N,
      p50: a.p50,
      p99: a.p99,
      c: cost(s0, s1, N),
      note: 'queue.add call start -> processor start, idle Worker; cost covers the whole add+process+wait loop',
    });
    const b = percentiles(completions);
    emit('idle_completion_latency', {
      items: N,
      p50: b.p50,
      p99: b.p99,
      note: 'processor end -> job.waitUntilFinished(QueueEvents) resolves in producer',
    });
    const w2 = percentiles(wholes);
    emit('idle_round_trip', {
      items: N,
      p50: w2.p50,
      p99: w2.p99,
      note: 'queue.add call start -> job.waitUntilFinished resolves, idle Worker, no-op processor',
    });
  },

  // A flow of one parent and one child, one at a time on an idle Worker: the child's processor end ->
  // the parent's processor start (BullMQ moves the parent to wait when its last child completes).
  async flow_release(ctx) {
    const N = scaled(1000);
    const q = ctx.queue('release');
    const fp = ctx.flowProducer();
    const qe = ctx.events('release');
    const ends = new Map();
    const starts = new Map();
    const w = ctx.worker('release', async (job) => {
      if (job.name === 'parent') starts.set(job.data.pair, now());
      else ends.set(job.data.pair, now()); // last thing before the processor returns
    });
    await Promise.all([q.waitUntilReady(), fp.waitUntilReady(), qe.waitUntilReady(), w.waitUntilReady()]);
    const once = async (pair) => {
      const tree = await fp.add({
        name: 'parent',
        queueName: 'release',
        data: { ...PAYLOAD, pair },
        children: [{ name: 'child', queueName: 'release', data: { ...PAYLOAD, pair } }],
      });
      await tree.job.waitUntilFinished(qe, 10_000);
      return starts.get(pair) - ends.get(pair);
    };
    for (let i = 0; i < 20; i++) await once(`warm-${i}`);
    await sleep(200);
    const lat = [];
    const s0 = await snapshot();
    for (let i = 0; i < N; i++) lat.push(await once(`p-${i}`));
    const s1 = await snapshot();
    const a = percentiles(lat);
    emit('flow_release', {
      items: N,
      p50: a.p50,
      p99: a.p99,
      c: cost(s0, s1, N),
      note: 'flow of 1 parent + 1 child, one at a time, idle Worker: child processor end -> parent processor start',
    });
  },

  async memory(ctx) {
    const N = scaled(100_000);
    const q = ctx.queue('memory');
    await q.waitUntilReady();
    const s0 = await snapshot();
    const t0 = now();
    await addBulk(q, N, {}); // default job options: the leanest job hash BullMQ stores
    const t1 = now();
    const s1 = await snapshot();
    emit('memory', {
      items: N,
      tput: N / ((t1 - t0) / 1000),
      c: cost(s0, s1, N),
      bytes: (s1.mem - s0.mem) / N,
      note: 'INFO used_memory delta, no worker, default job opts; incl. events stream (capped ~10k entries)',
    });
  },

  async priority_under_load(ctx) {
    await priorityUnderLoad(ctx, 'priority_under_load', scaled(1_000_000), 0);
  },

  // The same with handlers that take 1 ms each (as sluicegate's priority_busy).
  async priority_busy(ctx) {
    await priorityUnderLoad(ctx, 'priority_busy', scaled(200_000), 1);
  },
};

// A priority-1 job every 50 ms during a priority-1000 flood of N jobs whose processor takes
// workMs each (0: no-op): add start -> processor start.
async function priorityUnderLoad(ctx, scenario, N, workMs) {
  const HIGH = 100;
  const ADD_BUDGET_MS = 60_000; // issue 4: reduce the flood to what fits in ~60 s of adding
  const q = ctx.queue('prio');
  await q.waitUntilReady();
  // BullMQ: lower number = higher priority (1 is highest; 0 means "no priority" and goes first).
  const s0 = await snapshot();
  const t0 = now();
  let added = 0;
  while (added < N && now() - t0 < ADD_BUDGET_MS) {
    const n = Math.min(BATCH, N - added);
    await addBulk(q, n, { priority: 1000, removeOnComplete: true }, 'low');
    added += n;
  }
  const t1 = now();
  const s1 = await snapshot();
  const cut = added < N ? `; cut to ${added} by the ${ADD_BUDGET_MS / 1000}s add budget` : '';
  emit(scenario === 'priority_under_load' ? 'priority_add' : `${scenario}_add`, {
    items: added,
    tput: added / ((t1 - t0) / 1000),
    c: cost(s0, s1, added),
    note: `addBulk batches of ${BATCH}, priority 1000${cut}`,
  });

  const lat = [];
  let processed = 0;
  const highDone = deferred();
  const w = ctx.worker('prio', async (job) => {
    if (job.name === 'high') {
      lat.push(now() - job.data.t0);
      if (lat.length === HIGH) highDone.resolve(now());
    }
    if (workMs > 0) await sleep(workMs);
  });
  w.on('completed', () => processed++);
  await w.waitUntilReady();
  await sleep(1000); // let the worker reach steady state on the flood first
  const p0 = processed;
  const s2 = await snapshot();
  const t2 = now();
  // As sluicegate's bench: how long Redis took to answer another client's PING meanwhile (the
  // wait any one command has in its queue), from a prober in its own thread.
  const probed = await pings(async () => {
    for (let i = 0; i < HIGH; i++) {
      await q.add('high', { ...PAYLOAD, t0: now() }, { priority: 1, removeOnComplete: true });
      const next = t2 + (i + 1) * 50; // fixed 50 ms schedule, not 50 ms after each add returns
      if (next > now()) await sleep(next - now());
    }
    await highDone.promise;
  }, 10);
  const pinged = percentiles(probed);
  const t3 = now();
  const s3 = await snapshot();
  const jobs = processed - p0;
  const left = await q.getPrioritizedCount();
  const a = percentiles(lat);
  emit(scenario, {
    items: HIGH,
    tput: jobs / ((t3 - t2) / 1000),
    p50: a.p50,
    p99: a.p99,
    c: cost(s2, s3, jobs),
    note:
      `high (priority 1) add start -> processor start, every 50 ms during a ${added}-job priority-1000 flood, ` +
      `${workMs > 0 ? `processors of ${workMs} ms` : 'no-op processors'}; ` +
      `throughput and cost per job processed in that window; ${left} low jobs still queued at end; ` +
      `PING from another client p50 ${pinged.p50.toFixed(3)} ms, p99 ${pinged.p99.toFixed(3)} ms (${probed.length} pings)` +
      (left === 0 ? ' (FLOOD RAN OUT: figures not under load)' : ''),
  });
}

// Adds P flows of C children (parents and children in one queue, one Worker), then processes them.
async function runFlows(ctx, name, P, C, flowsPerCall) {
  const q = ctx.queue(name);
  const fp = ctx.flowProducer();
  await Promise.all([q.waitUntilReady(), fp.waitUntilReady()]);
  const child = { name: 'child', queueName: name, data: PAYLOAD, opts: { removeOnComplete: true } };
  const flow = () => ({
    name: 'parent',
    queueName: name,
    data: PAYLOAD,
    opts: { removeOnComplete: true },
    children: Array.from({ length: C }, () => child),
  });
  const items = P * C;
  const s0 = await snapshot();
  const t0 = now();
  const blocked = await worstPing(async () => {
    for (let i = 0; i < P; i += flowsPerCall) {
      const batch = Array.from({ length: Math.min(flowsPerCall, P - i) }, flow);
      if (batch.length === 1) await fp.add(batch[0]);
      else await fp.addBulk(batch);
    }
  });
  const t1 = now();
  const s1 = await snapshot();
  const how = flowsPerCall === 1 ? 'FlowProducer.add per flow' : `FlowProducer.addBulk of ${flowsPerCall} flows`;
  emit(`${name}_add`, {
    items,
    tput: items / ((t1 - t0) / 1000),
    c: cost(s0, s1, items),
    note:
      `${P} parents x ${C} children, ${how}; per child (parents add ${P} jobs); ` +
      `node rss ${Math.round(process.memoryUsage().rss / 2 ** 20)} MiB after adding; ` +
      `worst PING during adding ${Math.round(blocked)} ms (other client; each add is one MULTI/EXEC)`,
  });

  const w = ctx.worker(name, async () => {}, { autorun: false });
  const run = await drain(ctx, w, P, (job) => job.name === 'parent');
  emit(name, {
    items,
    tput: items / (run.ms / 1000),
    c: cost(run.before, run.after, items),
    note: `children/s, worker start -> all ${P} parents completed; 1 Worker, concurrency ${CONCURRENCY}; removeOnComplete`,
  });
}

// ---------------------------------------------------------------------------- main
async function sweepKeys() {
  // Belt and braces after obliterate: anything left under this run's prefix goes.
  let cursor = '0';
  let n = 0;
  do {
    const [next, keys] = await stats.scan(cursor, 'MATCH', `${PREFIX}:*`, 'COUNT', 1000);
    cursor = next;
    if (keys.length) n += await stats.unlink(...keys);
  } while (cursor !== '0');
  return n;
}

async function main() {
  const wanted = process.argv.slice(2);
  const names = wanted.length ? wanted : Object.keys(scenarios);
  const unknown = names.filter((n) => !scenarios[n]);
  if (unknown.length) {
    console.error(`bench.mjs: unknown scenario(s) ${unknown.join(', ')}; known: ${Object.keys(scenarios).join(', ')}`);
    process.exit(2);
  }
  const bullmqVersion = createRequire(import.meta.url)('bullmq/package.json').version;
  const server = infoFields(await stats.info('server'));
  emit('meta', {
    items: 0,
    note:
      `bullmq ${bullmqVersion}, node ${process.version}, loadavg ${os.loadavg().map((x) => x.toFixed(2)).join(' ')}, ` +
      `redis ${server.get('redis_version')}, cpus ${os.cpus().length}, scale ${SCALE}, prefix ${PREFIX}`,
  });

  let failed = 0;
  const tAll = now();
  for (const name of names) {
    const ctx = new Ctx();
    const t = now();
    log(`${name}: start`);
    let timer;
    try {
      await Promise.race([
        scenarios[name](ctx),
        ctx.failure.promise,
        new Promise((_, rej) => (timer = setTimeout(() => rej(new Error(`timed out after ${TIMEOUT_MS / 1000}s`)), TIMEOUT_MS))),
      ]);
    } catch (e) {
      failed++;
      log(`${name}: FAILED: ${e?.stack ?? e}`);
    } finally {
      clearTimeout(timer);
      ctx.failure.promise.catch(() => {}); // late errors from closing connections are not failures
      // Cleanup gets its own deadline: BullMQ connections retry forever if Redis went away.
      const stuck = setTimeout(() => {
        log(`${name}: cleanup stuck for 120s, giving up (keys under ${PREFIX}:* may remain)`);
        process.exit(1);
      }, 120_000);
      await ctx.cleanup();
      const left = await sweepKeys();
      clearTimeout(stuck);
      if (left) log(`${name}: ${left} keys were left after obliterate and have been removed`);
      log(`${name}: done in ${((now() - t) / 1000).toFixed(1)}s (incl. cleanup)`);
    }
  }
  log(`all done in ${((now() - tAll) / 1000).toFixed(1)}s, ${failed} failed`);
  await stats.quit();
  process.exit(failed ? 1 : 0);
}

process.on('SIGINT', async () => {
  log('interrupted, removing keys');
  await sweepKeys().catch(() => {});
  process.exit(130);
});

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
