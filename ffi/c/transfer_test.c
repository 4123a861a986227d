/*
 * The C ABI end to end, from C: two endpoints (one created from a config, one joining a cluster
 * file) in one process; WRITEs of the caller's own memory and READs, verified byte by byte,
 * through the completion queue; SEND/RECV, and a WRITE with its notification; errors provoked and their messages printed; the
 * metrics text; a multicast planned and executed with LayerReady progress; clean teardown.
 *
 * Built and run by ffi/tests/c_abi.rs (cc -std=c11 -Wall -Wextra -Werror). Usage:
 *   transfer_test PORT0 PORT1 WORKDIR
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cascade.h"

#define CHECK(call)                                                                         \
    do {                                                                                    \
        int32_t rc_ = (call);                                                               \
        if (rc_ != CASCADE_OK) {                                                            \
            fprintf(stderr, "%s:%d: %s returned %d: %s\n", __FILE__, __LINE__, #call, rc_, \
                    cascade_last_error());                                                  \
            exit(1);                                                                        \
        }                                                                                   \
    } while (0)

#define EXPECT(cond)                                                               \
    do {                                                                           \
        if (!(cond)) {                                                             \
            fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond);    \
            exit(1);                                                               \
        }                                                                          \
    } while (0)

enum { LEN = 1 << 20, PARTS = 4 };

static void sleep_ms(long ms) {
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

/* Polls `ep` until `want` completions arrived (at most 20 s), into `out`. */
static void poll_n(cascade_endpoint *ep, cascade_completion *out, size_t want) {
    size_t got = 0;
    for (int i = 0; i < 20000 && got < want; i++) {
        size_t n = 0;
        int32_t rc = cascade_poll(ep, out + got, want - got, &n);
        EXPECT(rc == CASCADE_OK || rc == CASCADE_IN_PROGRESS);
        got += n;
        if (n == 0) sleep_ms(1);
    }
    EXPECT(got == want);
}

/* One operation of `kind` between offset 0 of `local` and of `remote`. */
static cascade_op one_op(uint32_t kind, const cascade_region *local, cascade_remote_region remote,
                         uint64_t len, uint64_t tag) {
    cascade_op op;
    memset(&op, 0, sizeof op);
    op.struct_size = sizeof op;
    op.kind = kind;
    op.local = local;
    op.remote = remote;
    op.len = len;
    op.tag = tag;
    return op;
}

/* Waits (at most 5 s) for a message on `ep`; returns cascade_recv's last status. */
static int32_t recv_wait(cascade_endpoint *ep, uint32_t *from, uint64_t *tag, uint8_t *buf, size_t cap,
                         size_t *needed) {
    int32_t rc = CASCADE_IN_PROGRESS;
    for (int i = 0; i < 5000 && rc == CASCADE_IN_PROGRESS; i++) {
        rc = cascade_recv(ep, from, tag, buf, cap, needed);
        if (rc == CASCADE_IN_PROGRESS) sleep_ms(1);
    }
    return rc;
}

static void wait_ready(cascade_endpoint *ep) {
    for (int i = 0; i < 100; i++) {
        int32_t rc = cascade_endpoint_wait_ready(ep, 100);
        if (rc == CASCADE_OK) return;
        EXPECT(rc == CASCADE_IN_PROGRESS);
    }
    fprintf(stderr, "the mesh never came up\n");
    exit(1);
}

static void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    EXPECT(f != NULL);
    fputs(text, f);
    fclose(f);
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s PORT0 PORT1 WORKDIR\n", argv[0]);
        return 2;
    }
    EXPECT(cascade_abi_version() == CASCADE_ABI_VERSION);
    printf("cascade %s, ABI %u\n", cascade_version(), cascade_abi_version());

    char toml[512];
    snprintf(toml, sizeof toml,
             "name = \"c-abi-%d\"\n"
             "[[nodes]]\nid = 0\naddr = \"127.0.0.1:%s\"\n"
             "[[nodes]]\nid = 1\naddr = \"127.0.0.1:%s\"\n",
             (int)getpid(), argv[1], argv[2]);
    const char *secret = "c-abi-secret";

    /* Node 0 from a config struct. */
    cascade_endpoint_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.struct_size = sizeof cfg;
    cfg.node = 0;
    cfg.cluster_toml = toml;
    cfg.secret = (const uint8_t *)secret;
    cfg.secret_len = strlen(secret);
    cfg.op_timeout_ms = 10000;
    cascade_endpoint *ep0 = NULL;
    CHECK(cascade_endpoint_create(&cfg, &ep0));

    /* Node 1 joins from the cluster file. */
    char cluster_path[1024], secret_path[1024];
    snprintf(cluster_path, sizeof cluster_path, "%s/cluster.toml", argv[3]);
    snprintf(secret_path, sizeof secret_path, "%s/secret", argv[3]);
    write_file(cluster_path, toml);
    write_file(secret_path, secret);
    cascade_endpoint *ep1 = NULL;
    CHECK(cascade_endpoint_join(cluster_path, 1, secret_path, &ep1));
    wait_ready(ep0);
    wait_ready(ep1);
    uint32_t node = 99;
    CHECK(cascade_endpoint_node(ep1, &node));
    EXPECT(node == 1);

    /* The caller's own memory, registered on both sides. */
    uint8_t *src = aligned_alloc(4096, LEN);
    uint8_t *dst = aligned_alloc(4096, LEN);
    EXPECT(src != NULL && dst != NULL);
    for (size_t i = 0; i < LEN; i++) src[i] = (uint8_t)(i * 7 + 3);
    memset(dst, 0, LEN);
    cascade_region *r_src = NULL, *r_dst = NULL, *r_lib = NULL;
    CHECK(cascade_region_register(ep0, src, LEN, &r_src));
    CHECK(cascade_region_register(ep1, dst, LEN, &r_dst));
    CHECK(cascade_region_alloc(ep1, LEN, &r_lib));
    cascade_remote_region d_dst, d_lib;
    CHECK(cascade_region_descriptor(r_dst, &d_dst));
    CHECK(cascade_region_descriptor(r_lib, &d_lib));
    EXPECT(d_dst.node == 1 && d_dst.len == LEN);

    /* A batch of verified WRITEs, one per part. */
    cascade_op ops[PARTS];
    memset(ops, 0, sizeof ops);
    for (int i = 0; i < PARTS; i++) {
        ops[i].struct_size = sizeof(cascade_op);
        ops[i].kind = CASCADE_OP_WRITE;
        ops[i].local = r_src;
        ops[i].local_offset = (uint64_t)i * (LEN / PARTS);
        ops[i].remote = d_dst;
        ops[i].remote_offset = (uint64_t)i * (LEN / PARTS);
        ops[i].len = LEN / PARTS;
        ops[i].flags = CASCADE_OP_VERIFY;
        ops[i].tag = 100 + (uint64_t)i;
    }
    CHECK(cascade_post(ep0, ops, PARTS));
    cascade_completion done[PARTS];
    poll_n(ep0, done, PARTS);
    uint64_t tags = 0;
    for (int i = 0; i < PARTS; i++) {
        EXPECT(done[i].status == CASCADE_OK && done[i].kind == CASCADE_EVENT_WRITE);
        EXPECT(done[i].bytes == LEN / PARTS && done[i].node == 1);
        tags |= 1ull << (done[i].tag - 100);
    }
    EXPECT(tags == (1u << PARTS) - 1);
    EXPECT(memcmp(src, dst, LEN) == 0);
    printf("wrote %d bytes in %d verified WRITEs\n", LEN, PARTS);

    /* A READ of the library-allocated region into our own memory. */
    uint8_t *lib = NULL;
    CHECK(cascade_region_ptr(r_lib, &lib));
    for (size_t i = 0; i < LEN; i++) lib[i] = (uint8_t)(i ^ 0x5a);
    cascade_op rd = one_op(CASCADE_OP_READ, r_src, d_lib, LEN, 7);
    CHECK(cascade_post(ep0, &rd, 1));
    poll_n(ep0, done, 1);
    EXPECT(done[0].status == CASCADE_OK && done[0].kind == CASCADE_EVENT_READ && done[0].tag == 7);
    EXPECT(memcmp(src, lib, LEN) == 0);
    printf("read %d bytes back\n", LEN);

    /* SEND/RECV, with a buffer too small first. */
    const char *hello = "hello from node 0";
    CHECK(cascade_send(ep0, 1, 42, (const uint8_t *)hello, strlen(hello)));
    poll_n(ep0, done, 1);
    EXPECT(done[0].kind == CASCADE_EVENT_SEND && done[0].status == CASCADE_OK && done[0].tag == 42);
    uint8_t small[4], big[64];
    size_t needed = 0;
    uint32_t from = 99;
    uint64_t tag = 0;
    int32_t rc = recv_wait(ep1, &from, &tag, small, sizeof small, &needed);
    EXPECT(rc == CASCADE_ERR_BUFFER_TOO_SMALL && needed == strlen(hello));
    CHECK(cascade_recv(ep1, &from, &tag, big, sizeof big, &needed));
    EXPECT(from == 0 && tag == 42 && needed == strlen(hello) && memcmp(big, hello, needed) == 0);
    printf("received \"%.*s\" (tag %llu) from node %u\n", (int)needed, (const char *)big,
           (unsigned long long)tag, from);

    /* A WRITE and its notification in one call: the message is received after the bytes. */
    for (size_t i = 0; i < LEN; i++) src[i] = (uint8_t)(i * 13 + 1);
    cascade_op w = one_op(CASCADE_OP_WRITE, r_src, d_dst, LEN, 44);
    const char *note = "written";
    CHECK(cascade_post_notify(ep0, &w, 1, 45, (const uint8_t *)note, strlen(note)));
    rc = recv_wait(ep1, &from, &tag, big, sizeof big, &needed);
    EXPECT(rc == CASCADE_OK && from == 0 && tag == 45 && needed == strlen(note));
    EXPECT(memcmp(src, dst, LEN) == 0);
    poll_n(ep0, done, 2);
    for (int i = 0; i < 2; i++) {
        EXPECT(done[i].status == CASCADE_OK && done[i].node == 1);
        EXPECT((done[i].kind == CASCADE_EVENT_WRITE && done[i].tag == 44 && done[i].bytes == LEN) ||
               (done[i].kind == CASCADE_EVENT_SEND && done[i].tag == 45 && done[i].bytes == strlen(note)));
    }
    EXPECT(done[0].kind != done[1].kind);
    printf("notified \"%s\" behind a %d-byte WRITE\n", note, LEN);
    rc = cascade_post_notify(ep0, &w, 0, 46, (const uint8_t *)note, strlen(note));
    EXPECT(rc == CASCADE_ERR_INVALID_ARGUMENT);

    /* Errors: a bad argument is refused at once; an access beyond the peer's region fails in
       its completion, with the peer's reason as detail. */
    rd.kind = 77;
    rc = cascade_post(ep0, &rd, 1);
    EXPECT(rc == CASCADE_ERR_INVALID_ARGUMENT);
    printf("provoked error %d: %s\n", rc, cascade_last_error());
    rc = cascade_endpoint_create(NULL, &ep0);
    EXPECT(rc == CASCADE_ERR_INVALID_ARGUMENT);
    printf("provoked error %d: %s\n", rc, cascade_last_error());
    ops[0].remote_offset = LEN - 10;
    ops[0].tag = 9;
    CHECK(cascade_post(ep0, ops, 1));
    poll_n(ep0, done, 1);
    EXPECT(done[0].tag == 9 && done[0].status == CASCADE_ERR_REFUSED);
    char detail[512];
    CHECK(cascade_completion_detail(ep0, 9, detail, sizeof detail, &needed));
    printf("refused WRITE (status %d): %s\n", done[0].status, detail);

    /* Metrics: the same text /metrics serves; it counts what we just moved. */
    char *text = NULL;
    needed = 0;
    rc = cascade_metrics_render(ep0, NULL, 0, &needed);
    EXPECT(rc == CASCADE_ERR_BUFFER_TOO_SMALL && needed > 0);
    text = malloc(needed);
    CHECK(cascade_metrics_render(ep0, text, needed, &needed));
    EXPECT(strstr(text, "cascade_transfer_bytes_total{op=\"write\"") != NULL);
    EXPECT(strstr(text, "cascade_transfer_errors_total{op=\"write\"") != NULL);
    free(text);
    char addr[CASCADE_ADDR_CAP], tiny[8];
    rc = cascade_metrics_serve(ep0, "127.0.0.1:0", tiny, sizeof tiny, &needed);
    EXPECT(rc == CASCADE_ERR_BUFFER_TOO_SMALL && needed == CASCADE_ADDR_CAP);
    CHECK(cascade_metrics_serve(ep0, "127.0.0.1:0", addr, sizeof addr, &needed));
    EXPECT(strncmp(addr, "127.0.0.1:", 10) == 0);
    printf("metrics at http://%s/metrics\n", addr);

    /* A multicast: planned, then executed from our registered memory as its source. */
    const char *req = "{\"bytes\": 1048576, \"sources\": [\"0/host\"], \"targets\": [\"1/host\"]}";
    char plan[4096];
    CHECK(cascade_multicast_plan(ep0, req, plan, sizeof plan, &needed));
    EXPECT(strstr(plan, "\"edges\"") != NULL);
    printf("plan: %s\n", plan);
    rc = cascade_multicast_execute(ep0, "{\"targets\": [\"1/host\"], \"layers\": 4, \"hold\": true}", r_src, 5);
    EXPECT(rc == CASCADE_IN_PROGRESS);
    int layers = 0, finished = 0;
    unsigned long run = 0;
    for (int i = 0; i < 30000 && !finished; i++) {
        size_t n = 0;
        cascade_completion c;
        cascade_poll(ep0, &c, 1, &n);
        if (n == 0) {
            sleep_ms(1);
            continue;
        }
        EXPECT(c.tag == 5);
        if (c.kind == CASCADE_EVENT_LAYER_READY) {
            EXPECT(c.node == 1 && c.layer == (uint32_t)layers);
            layers++;
        } else if (c.kind == CASCADE_EVENT_MULTICAST_DONE) {
            char out[4096];
            CHECK(cascade_completion_detail(ep0, 5, out, sizeof out, &needed));
            printf("multicast done (status %d): %s\n", c.status, out);
            EXPECT(c.status == CASCADE_OK);
            const char *at = strstr(out, "\"run\":");
            EXPECT(at != NULL);
            run = strtoul(at + 6, NULL, 10);
            finished = 1;
        }
    }
    EXPECT(finished && layers == 4);
    /* The target's node takes its verified copy; the controller then ends the run. */
    cascade_region *taken = NULL;
    rc = cascade_multicast_take(ep1, (uint32_t)run, "0/host", &taken);
    EXPECT(rc == CASCADE_ERR_INVALID_ARGUMENT);
    CHECK(cascade_multicast_take(ep1, (uint32_t)run, "1/host", &taken));
    uint8_t *copy = NULL;
    CHECK(cascade_region_ptr(taken, &copy));
    EXPECT(memcmp(copy, src, LEN) == 0);
    CHECK(cascade_multicast_release(ep0, (uint32_t)run));
    EXPECT(cascade_multicast_release(ep0, (uint32_t)run) == CASCADE_ERR_INVALID_ARGUMENT);
    printf("node 1 took its copy of run %lu: %d bytes equal to the source\n", run, LEN);
    CHECK(cascade_region_deregister(ep1, taken, 5000));

    /* Teardown: regions first (they wait for nothing in flight), then endpoints. */
    CHECK(cascade_region_deregister(ep0, r_src, 5000));
    CHECK(cascade_region_deregister(ep1, r_dst, 5000));
    CHECK(cascade_region_deregister(ep1, r_lib, 5000));
    free(src);
    free(dst);
    CHECK(cascade_endpoint_destroy(ep0));
    CHECK(cascade_endpoint_destroy(ep1));
    printf("ok\n");
    return 0;
}
