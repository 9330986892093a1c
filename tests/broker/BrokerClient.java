import java.io.File;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.BitSet;
import java.util.Collections;
import java.util.HashMap;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;

import org.apache.rocketmq.client.consumer.DefaultMQPullConsumer;
import org.apache.rocketmq.client.consumer.PullResult;
import org.apache.rocketmq.client.consumer.PullStatus;
import org.apache.rocketmq.client.producer.DefaultMQProducer;
import org.apache.rocketmq.client.producer.SendResult;
import org.apache.rocketmq.client.producer.SendStatus;
import org.apache.rocketmq.client.QueryResult;
import org.apache.rocketmq.common.TopicConfig;
import org.apache.rocketmq.common.message.Message;
import org.apache.rocketmq.common.message.MessageAccessor;
import org.apache.rocketmq.common.message.MessageExt;
import org.apache.rocketmq.common.message.MessageQueue;
import org.apache.rocketmq.tools.admin.DefaultMQAdminExt;

/**
 * The broker tests' client, compiled with javac against the rocketmq-client/tools of the version under test.
 * Every message is a pure function of its sequence number (topic, queue, tags, keys, user properties, body),
 * so a reader checks each message it gets against what was sent without a shared log. One JSON line of results
 * goes to stdout; a producer writes the sequence numbers the broker acknowledged (SEND_OK) as a BitSet file,
 * and when each acknowledgement came back (big-endian epoch ms per message, 0 for none) to ACKED_FILE.ms.
 *
 *   topics  NS BROKER_ADDR QUEUES TOPIC[:QUEUES]...   create (or update) topics
 *   deltopic NS BROKER_ADDR TOPIC [QUEUES]             delete a topic from the broker and the name server,
 *                                                      then create it again with QUEUES queues if given
 *   config  NS BROKER_ADDR KEY=VALUE...                change broker (and store) settings at run time
 *   produce NS BROKER_NAME TOPICS QUEUES START COUNT BODY THREADS ACKED_FILE [DELIVER_AT_MS]
 *   consume NS BROKER_NAME TOPICS QUEUES START COUNT BODY GROUP ACKED_FILE|- [WAIT_SECONDS [POSITIONS_FILE]]
 *           POSITIONS_FILE: where the broker stored each message read, per sequence number from START
 *           (big-endian CommitLog offset, queue offset; -1, -1 for one not read)
 *   query   NS TOPICS START COUNT BODY N              key queries for N sequence numbers spread over the range
 */
public final class BrokerClient {
    static String[] topics(String csv) { return csv.split(","); }

    static String topicOf(String[] topics, long seq) { return topics[(int) (seq % topics.length)]; }

    static int queueOf(String[] topics, int queues, long seq) { return (int) ((seq / topics.length) % queues); }

    static byte[] body(long seq, int size) {
        byte[] unit = String.format("m%012d|", seq).getBytes(StandardCharsets.US_ASCII);
        byte[] b = new byte[size];
        for (int i = 0; i < size; i++) b[i] = unit[i % unit.length];
        return b;
    }

    static String tag(long seq) { return "T" + (seq % 5); }

    static String key(long seq) { return "K" + seq; }

    static String prop(long seq) { return "v" + ((seq * 7919) % 100003); }

    static Message message(String[] topics, long seq, int size) {
        Message m = new Message(topicOf(topics, seq), tag(seq), key(seq), body(seq, size));
        m.putUserProperty("seq", Long.toString(seq));
        m.putUserProperty("p", prop(seq));
        return m;
    }

    /** Null when `m` is exactly the message `seq` names, else what differs. */
    static String check(MessageExt m, String[] topics, int queues, int size, long start, long count) {
        String s = m.getUserProperty("seq");
        if (s == null) return "no seq property at offset " + m.getQueueOffset();
        long seq = Long.parseLong(s);
        if (seq < start || seq >= start + count) return "seq " + seq + " out of range";
        if (!m.getTopic().equals(topicOf(topics, seq))) return "seq " + seq + " in topic " + m.getTopic();
        if (m.getQueueId() != queueOf(topics, queues, seq)) return "seq " + seq + " in queue " + m.getQueueId();
        if (!tag(seq).equals(m.getTags())) return "seq " + seq + " tags " + m.getTags();
        if (!key(seq).equals(m.getKeys())) return "seq " + seq + " keys " + m.getKeys();
        if (!prop(seq).equals(m.getUserProperty("p"))) return "seq " + seq + " property p " + m.getUserProperty("p");
        if (!Arrays.equals(body(seq, size), m.getBody())) return "seq " + seq + " body differs";
        return null;
    }

    /** The sequence number a message was sent with, even when its tail (the properties) is torn: from the
     *  "seq" property, else from the body, which begins "m%012d|"; -1 when neither survives. */
    static long seqOf(MessageExt m) {
        String s = m.getUserProperty("seq");
        try {
            if (s != null) return Long.parseLong(s);
        } catch (NumberFormatException e) {
            // torn: try the body
        }
        byte[] b = m.getBody();
        if (b != null && b.length >= 14 && b[0] == 'm' && b[13] == '|') {
            try {
                return Long.parseLong(new String(b, 1, 12, StandardCharsets.US_ASCII));
            } catch (NumberFormatException e) {
                return -1;
            }
        }
        return -1;
    }

    static String json(Map<String, Object> o) {
        StringBuilder b = new StringBuilder("{");
        for (Map.Entry<String, Object> e : o.entrySet()) {
            if (b.length() > 1) b.append(',');
            b.append('"').append(e.getKey()).append("\":");
            Object v = e.getValue();
            if (v instanceof Number || v instanceof Boolean) b.append(v);
            else if (v instanceof List) {
                b.append('[');
                List<?> l = (List<?>) v;
                for (int i = 0; i < l.size(); i++) b.append(i == 0 ? "" : ",").append(quote(String.valueOf(l.get(i))));
                b.append(']');
            } else b.append(quote(String.valueOf(v)));
        }
        return b.append('}').toString();
    }

    static String quote(String s) {
        return '"' + s.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", " ") + '"';
    }

    static BitSet readBits(String path) throws Exception {
        return BitSet.valueOf(Files.readAllBytes(new File(path).toPath()));
    }

    static void writeBits(String path, BitSet bits) throws Exception {
        File tmp = new File(path + ".tmp");
        Files.write(tmp.toPath(), bits.toByteArray());
        Files.move(tmp.toPath(), new File(path).toPath(), java.nio.file.StandardCopyOption.ATOMIC_MOVE);
    }

    public static void main(String[] a) {
        try {
            run(a);
        } catch (Throwable e) {  // exit even though client threads (not daemons) are still running
            e.printStackTrace();
            System.exit(1);
        }
    }

    static void run(String[] a) throws Exception {
        Map<String, Object> out;
        switch (a[0]) {
            case "topics": out = topics(a); break;
            case "deltopic": out = deltopic(a); break;
            case "config": out = config(a); break;
            case "produce": out = produce(a); break;
            case "consume": out = consume(a); break;
            case "query": out = query(a); break;
            default: throw new IllegalArgumentException("unknown command " + a[0]);
        }
        System.out.println(json(out));
        System.out.flush();
        // No client shutdown(): a 5.x client takes seconds to close its Netty event loops gracefully, and exiting
        // closes the connections all the same (every send and pull above has completed).
        System.exit(0);
    }

    interface RouteLookup { Object fetch(String topic) throws Exception; }

    /** Wait (60 s at most) until the name server has a route for every topic: a 5.x broker prints "boot
     *  success" before its re-registration after a restart reaches the name server. */
    static void awaitRoutes(String[] topics, RouteLookup lookup) throws Exception {
        long deadline = System.currentTimeMillis() + 60_000;
        for (String t : topics) {
            while (true) {
                try {
                    if (!((java.util.Collection<?>) lookup.fetch(t)).isEmpty()) break;
                } catch (Exception e) {
                    if (System.currentTimeMillis() > deadline) throw e;
                }
                Thread.sleep(200);
            }
        }
    }

    static DefaultMQAdminExt admin(String ns) throws Exception {
        DefaultMQAdminExt admin = new DefaultMQAdminExt(5000);
        admin.setNamesrvAddr(ns);
        admin.setVipChannelEnabled(false);
        admin.setInstanceName("admin-" + System.nanoTime());
        admin.start();
        return admin;
    }

    static Map<String, Object> topics(String[] a) throws Exception {
        DefaultMQAdminExt admin = admin(a[1]);
        for (int i = 4; i < a.length; i++) {
            String[] nq = a[i].split(":", 2);  // TOPIC or TOPIC:QUEUES
            int queues = Integer.parseInt(nq.length > 1 ? nq[1] : a[3]);
            TopicConfig tc = new TopicConfig(nq[0]);
            tc.setReadQueueNums(queues);
            tc.setWriteQueueNums(queues);
            createTopic(admin, a[2], tc);
        }
        Map<String, Object> out = new HashMap<>();
        out.put("created", a.length - 4);
        return out;
    }

    /** Create (or update: idempotent) a topic on the broker, asking again while the broker does not answer in
     *  time (2 minutes at most): a broker just started on a loaded machine (a cold JVM, a DLedger member not yet
     *  its group's leader) let the admin call time out after 5 s in a CI run. */
    static void createTopic(DefaultMQAdminExt admin, String broker, TopicConfig tc) throws Exception {
        long deadline = System.currentTimeMillis() + 120_000;
        while (true) {
            try {
                admin.createAndUpdateTopicConfig(broker, tc);
                return;
            } catch (org.apache.rocketmq.remoting.exception.RemotingException e) {  // timeout, connect, send
                if (System.currentTimeMillis() > deadline) throw e;
                System.err.println("createTopic " + tc.getTopicName() + " on " + broker + ": " + e + "; again");
                Thread.sleep(500);
            }
        }
    }

    static Map<String, Object> deltopic(String[] a) throws Exception {
        DefaultMQAdminExt admin = admin(a[1]);
        admin.deleteTopicInBroker(new HashSet<>(Collections.singletonList(a[2])), a[3]);
        Set<String> ns = new HashSet<>(Collections.singletonList(a[1]));
        try {  // 5.x: (addrs, clusterName, topic); 4.9: (addrs, topic)
            DefaultMQAdminExt.class.getMethod("deleteTopicInNameServer", Set.class, String.class, String.class)
                .invoke(admin, ns, "TierfsCluster", a[3]);
        } catch (NoSuchMethodException e) {
            DefaultMQAdminExt.class.getMethod("deleteTopicInNameServer", Set.class, String.class).invoke(admin, ns, a[3]);
        }
        if (a.length > 4) {
            TopicConfig tc = new TopicConfig(a[3]);
            tc.setReadQueueNums(Integer.parseInt(a[4]));
            tc.setWriteQueueNums(Integer.parseInt(a[4]));
            createTopic(admin, a[2], tc);
        }
        Map<String, Object> out = new HashMap<>();
        out.put("deleted", a[3]);
        return out;
    }

    static Map<String, Object> config(String[] a) throws Exception {
        DefaultMQAdminExt admin = admin(a[1]);
        java.util.Properties props = new java.util.Properties();
        for (int i = 3; i < a.length; i++) {
            String[] kv = a[i].split("=", 2);
            props.setProperty(kv[0], kv[1]);
        }
        admin.updateBrokerConfig(a[2], props);
        Map<String, Object> out = new HashMap<>();
        out.put("updated", props.size());
        return out;
    }

    /** The arguments produce and consume share: NS BROKER_NAME TOPICS QUEUES START COUNT BODY. */
    static final class Workload {
        final String ns, brokerName;
        final String[] topics;
        final int queues, size;
        final long start, count;

        Workload(String[] a) {
            ns = a[1];
            brokerName = a[2];
            topics = topics(a[3]);
            queues = Integer.parseInt(a[4]);
            start = Long.parseLong(a[5]);
            count = Long.parseLong(a[6]);
            size = Integer.parseInt(a[7]);
        }
    }

    static Map<String, Object> produce(String[] a) throws Exception {
        Workload w = new Workload(a);
        String ns = w.ns, brokerName = w.brokerName;
        String[] topics = w.topics;
        int queues = w.queues, size = w.size, threads = Integer.parseInt(a[8]);
        long start = w.start, count = w.count;
        String ackedFile = a[9];
        long deliverAt = a.length > 10 ? Long.parseLong(a[10]) : 0;
        DefaultMQProducer producer = new DefaultMQProducer("tierfs-test-producer");
        producer.setNamesrvAddr(ns);
        producer.setVipChannelEnabled(false);
        producer.setSendMsgTimeout(15000);
        producer.setRetryTimesWhenSendFailed(0);
        producer.setCompressMsgBodyOverHowmuch(1 << 30);
        producer.start();
        awaitRoutes(topics, producer::fetchPublishMessageQueues);
        BitSet acked = new BitSet();
        List<String> errors = Collections.synchronizedList(new ArrayList<>());
        long[] latencies = new long[(int) count];
        long[] ackMs = new long[(int) count];  // wall-clock time each SEND_OK came back (0: not acknowledged)
        AtomicLong sent = new AtomicLong();
        long t0 = System.nanoTime();
        ExecutorService pool = Executors.newFixedThreadPool(threads);
        List<Future<?>> futures = new ArrayList<>();
        for (int t = 0; t < threads; t++) {
            final int tid = t;
            futures.add(pool.submit(() -> {
                for (long i = tid; i < count; i += threads) {
                    long seq = start + i;
                    Message m = message(topics, seq, size);
                    if (deliverAt > 0) {  // 5.x timer message (Message.setDeliverTimeMs is 5.x only)
                        MessageAccessor.putProperty(m, "TIMER_DELIVER_MS", Long.toString(deliverAt));
                        m.putUserProperty("due", Long.toString(deliverAt));
                    }
                    MessageQueue mq = new MessageQueue(m.getTopic(), brokerName, queueOf(topics, queues, seq));
                    long s0 = System.nanoTime();
                    try {
                        SendResult r = producer.send(m, mq);
                        if (r.getSendStatus() != SendStatus.SEND_OK) {
                            errors.add("seq " + seq + ": " + r.getSendStatus());
                            return;  // this thread's acknowledged messages stay a prefix of its share
                        }
                    } catch (Throwable e) {
                        errors.add("seq " + seq + ": " + e);
                        return;
                    }
                    latencies[(int) i] = System.nanoTime() - s0;
                    ackMs[(int) i] = System.currentTimeMillis();
                    sent.incrementAndGet();
                    synchronized (acked) { acked.set((int) i); }
                }
            }));
        }
        for (Future<?> f : futures) f.get();
        double secs = (System.nanoTime() - t0) / 1e9;
        pool.shutdown();
        writeBits(ackedFile, acked);
        java.nio.ByteBuffer times = java.nio.ByteBuffer.allocate(8 * (int) count);
        for (long ms : ackMs) times.putLong(ms);
        Files.write(new File(ackedFile + ".ms").toPath(), times.array());
        long[] ok = Arrays.stream(latencies).filter(x -> x > 0).sorted().toArray();
        Map<String, Object> out = new HashMap<>();
        out.put("acked", sent.get());
        out.put("errors", errors.size());
        out.put("first_errors", errors.subList(0, Math.min(3, errors.size())));
        out.put("secs", secs);
        out.put("p99_ms", ok.length == 0 ? 0 : ok[(int) Math.min(ok.length - 1, Math.floor(ok.length * 0.99))] / 1e6);
        return out;
    }

    static Map<String, Object> consume(String[] a) throws Exception {
        Workload w = new Workload(a);
        String ns = w.ns, brokerName = w.brokerName;
        String[] topics = w.topics;
        int queues = w.queues, size = w.size;
        long start = w.start, count = w.count;
        String group = a[8];
        BitSet expected = a[9].equals("-") ? null : readBits(a[9]);
        long waitMs = a.length > 10 ? (long) (Double.parseDouble(a[10]) * 1000) : 0;
        String positionsFile = a.length > 11 ? a[11] : null;
        long[] positions = new long[(int) (2 * count)];
        Arrays.fill(positions, -1L);
        DefaultMQPullConsumer consumer = new DefaultMQPullConsumer(group);
        consumer.setNamesrvAddr(ns);
        consumer.setVipChannelEnabled(false);
        consumer.setConsumerPullTimeoutMillis(20000);
        consumer.start();
        awaitRoutes(topics, consumer::fetchSubscribeMessageQueues);
        BitSet seen = new BitSet();
        AtomicLong read = new AtomicLong(), dups = new AtomicLong(), bytes = new AtomicLong();
        List<String> bad = Collections.synchronizedList(new ArrayList<>());
        List<Long> badSeqs = Collections.synchronizedList(new ArrayList<>());
        AtomicLong badAcked = new AtomicLong();
        List<Long> lateMs = Collections.synchronizedList(new ArrayList<>());
        long t0 = System.nanoTime();
        long deadline = System.currentTimeMillis() + waitMs;
        ExecutorService pool = Executors.newFixedThreadPool(Math.min(8, topics.length * queues));
        List<Future<?>> futures = new ArrayList<>();
        for (String topic : topics) {
            for (int q = 0; q < queues; q++) {
                MessageQueue mq = new MessageQueue(topic, brokerName, q);
                futures.add(pool.submit(() -> {
                    long offset = 0;
                    while (true) {
                        PullResult r = consumer.pull(mq, "*", offset, 32);
                        if (r.getPullStatus() == PullStatus.FOUND) {
                            for (MessageExt m : r.getMsgFoundList()) {
                                String err = check(m, topics, queues, size, start, count);
                                if (err != null) {
                                    bad.add(err);
                                    long s = seqOf(m);
                                    badSeqs.add(s);
                                    boolean mayBeAcked = s < start || s >= start + count || expected == null
                                            || expected.get((int) (s - start));
                                    if (mayBeAcked) badAcked.incrementAndGet();
                                    continue;
                                }
                                long seq = Long.parseLong(m.getUserProperty("seq"));
                                String due = m.getUserProperty("due");
                                if (due != null) lateMs.add(m.getStoreTimestamp() - Long.parseLong(due));
                                read.incrementAndGet();
                                bytes.addAndGet(m.getBody().length);
                                synchronized (seen) {
                                    if (seen.get((int) (seq - start))) dups.incrementAndGet();
                                    seen.set((int) (seq - start));
                                    positions[(int) (2 * (seq - start))] = m.getCommitLogOffset();
                                    positions[(int) (2 * (seq - start)) + 1] = m.getQueueOffset();
                                }
                            }
                        } else if (r.getPullStatus() == PullStatus.OFFSET_ILLEGAL && r.getNextBeginOffset() > offset) {
                            // the queue starts later (retention): begin there
                        } else if (System.currentTimeMillis() >= deadline) {
                            return null;
                        } else {
                            Thread.sleep(100);
                        }
                        offset = r.getNextBeginOffset();
                        synchronized (seen) {
                            if (waitMs > 0 && seen.cardinality() >= count) return null;
                        }
                    }
                }));
            }
        }
        for (Future<?> f : futures) f.get();
        double secs = (System.nanoTime() - t0) / 1e9;
        pool.shutdown();
        if (positionsFile != null) {
            java.nio.ByteBuffer buf = java.nio.ByteBuffer.allocate(8 * positions.length);
            buf.asLongBuffer().put(positions);
            Files.write(new File(positionsFile).toPath(), buf.array());
        }
        Map<String, Object> out = new HashMap<>();
        out.put("read", read.get());
        out.put("distinct", seen.cardinality());
        out.put("dups", dups.get());
        out.put("bad", bad.size());
        out.put("first_bad", bad.subList(0, Math.min(3, bad.size())));
        out.put("bad_seqs", badSeqs.subList(0, Math.min(20, badSeqs.size())));
        out.put("bad_acked", badAcked.get());
        out.put("secs", secs);
        out.put("body_bytes", bytes.get());
        if (expected != null) {
            BitSet missing = (BitSet) expected.clone();
            missing.andNot(seen);
            out.put("expected", expected.cardinality());
            out.put("missing", missing.cardinality());
            List<Long> first = new ArrayList<>();
            for (int i = missing.nextSetBit(0); i >= 0 && first.size() < 5; i = missing.nextSetBit(i + 1)) first.add(start + i);
            out.put("first_missing", first);
        }
        if (!lateMs.isEmpty()) {
            out.put("late_ms_min", Collections.min(lateMs));
            out.put("late_ms_max", Collections.max(lateMs));
        }
        return out;
    }

    static Map<String, Object> query(String[] a) throws Exception {
        String ns = a[1];
        String[] topics = topics(a[2]);
        long start = Long.parseLong(a[3]), count = Long.parseLong(a[4]);
        int size = Integer.parseInt(a[5]), n = Integer.parseInt(a[6]);
        DefaultMQPullConsumer consumer = new DefaultMQPullConsumer("tierfs-test-query");
        consumer.setNamesrvAddr(ns);
        consumer.setVipChannelEnabled(false);
        consumer.start();
        awaitRoutes(topics, consumer::fetchSubscribeMessageQueues);
        int found = 0;
        List<String> bad = new ArrayList<>();
        long t0 = System.nanoTime();
        for (int i = 0; i < n; i++) {
            long seq = start + (count - 1) * i / Math.max(1, n - 1);
            QueryResult r = consumer.queryMessage(topicOf(topics, seq), key(seq), 32, 0, Long.MAX_VALUE);
            boolean ok = false;
            for (MessageExt m : r.getMessageList()) {
                if (key(seq).equals(m.getKeys()) && Arrays.equals(body(seq, size), m.getBody())) ok = true;
            }
            if (ok) found++;
            else bad.add("key " + key(seq) + ": " + r.getMessageList().size() + " results, none matching");
        }
        double secs = (System.nanoTime() - t0) / 1e9;
        Map<String, Object> out = new HashMap<>();
        out.put("queried", n);
        out.put("found", found);
        out.put("first_bad", bad.subList(0, Math.min(3, bad.size())));
        out.put("secs", secs);
        return out;
    }
}
