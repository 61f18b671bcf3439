// One short-lived BullMQ producer: a Queue, one add, close (bench/connect-cost.sh runs it N times).
//
//   REDIS_URL=redis://127.0.0.1:PORT node connect.mjs
import { Queue } from 'bullmq';

const url = process.env.REDIS_URL;
if (!url) {
  console.error('connect.mjs: REDIS_URL is required');
  process.exit(2);
}
const queue = new Queue('connect', { connection: { url } });
await queue.add('job', { p: '0123456789abcdef' }, { removeOnComplete: true });
await queue.close();
