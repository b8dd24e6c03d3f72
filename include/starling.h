/* starling: borrow a cluster's CPUs from an ordinary Linux program.
 *
 * Remote fork (SnowFlock at process level). Numbering: sf_clone returns 0 in
 * the caller (the parent) and 1..m in each of the m clones of a ticket.
 *
 *   sf_ticket_t *t = sf_request_ticket(n, false);
 *   int m  = sf_ticket_allocation(t);     // m <= n clones granted
 *   int id = sf_clone(t);                 // 0 parent, 1..m clone, -1 failure
 *   if (id > 0) { work(id, m); sf_exit(0); }
 *   sf_join(t);                           // waits for all clones
 *
 * Backend: STARLING_FORK_BACKEND=cluster (default) runs clones on the hosts
 * of the starling cluster (found as `starling exec` finds it); with no
 * reachable cluster sf_request_ticket fails. STARLING_FORK_BACKEND=local
 * runs them on this machine. sf_request_ticket reads the configuration each
 * time: the config file ($STARLING_CONFIG, else /etc/starling/config.toml),
 * then the STARLING_* variables (the README lists every setting); a bad
 * value makes it fail with the reason in sf_last_error().
 *
 * Only the calling thread follows a clone (as with fork). Clones see the
 * caller's memory (fetched lazily), its TLS, signal handlers, cwd, umask and
 * regular files at their offsets; stdio goes to the caller's; other pipes
 * read EOF / write EPIPE; sockets and other descriptors are closed. Memory a
 * clone allocates after the fork is local to it. Clones cannot clone.
 * Link with: -lstarling (plus -lpthread -ldl -lm for the static library).
 */
#ifndef STARLING_H
#define STARLING_H

#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct sf_ticket sf_ticket_t;

/* Reserve n >= 1 clones. NULL on failure (see sf_last_error).
 * hierarchical = false: clones spread over as many hosts as possible, each
 * restored on its own. hierarchical = true: each host's free cores are filled
 * first; a host restores the process once and forks its further clones from
 * that restore (before any memory is fetched: each still fetches lazily).
 * Either way every clone is a fork of the caller: its own PID (the first
 * clone on a host keeps the frozen template's), its own exit status. */
sf_ticket_t *sf_request_ticket(int n, bool hierarchical);
/* Number of clones granted (m <= n), -1 for a NULL ticket. */
int sf_ticket_allocation(const sf_ticket_t *t);
/* Fork: 0 in the parent, 1..m in the clones, -1 on failure (parent only). */
int sf_clone(sf_ticket_t *t);
/* Clone only: exit with status (runs atexit handlers, flushes stdio). */
void sf_exit(int status) __attribute__((noreturn));
/* Parent only: wait for every clone; 0 on success, -1 on failure. */
int sf_join(sf_ticket_t *t);
/* Exit status of clone id after sf_join/sf_kill (exit code, or 128+signal
 * if killed); -1 if unknown or still running. */
int sf_clone_status(const sf_ticket_t *t, int id);
/* Parent only: kill every clone at once; 0 on success, -1 on failure. */
int sf_kill(sf_ticket_t *t);
/* Message of the last failure in this thread (never NULL). */
const char *sf_last_error(void);

/* Extensions (not in SnowFlock's API). */
/* Counters of clone id's fault handler: which = 0 faults, 1 pages fetched
 * from the page server, 2 zero-filled, 3 read from files, 4 fetch requests,
 * 5 remove/unmap events, 6 page distribution (SF_DIST_*), 7 pages installed
 * from multicast without the clone asking (included in 1). -1 if unknown.
 * Cluster clones report them when they end. which = SF_CLONE_STAMP_*: when
 * each stage of the clone's critical path ended, CLOCK_REALTIME ns (0: not
 * recorded; the local backend records none of the host's). */
long long sf_clone_stat(const sf_ticket_t *t, int id, int which);
#define SF_CLONE_STAMP_TICKET 8           /* parent: ticket granted */
#define SF_CLONE_STAMP_TEMPLATE 9         /* parent: template forked, record read */
#define SF_CLONE_STAMP_DESCRIPTOR 10      /* parent: descriptor dumped, page server up */
#define SF_CLONE_STAMP_PLACED 11          /* head: task placed on a host */
#define SF_CLONE_STAMP_LAUNCH_RECEIVED 12 /* host: agent received the launch */
#define SF_CLONE_STAMP_VIEW_MOUNTED 13    /* host: file view + overlay mounted */
#define SF_CLONE_STAMP_SANDBOX_READY 14   /* host: descriptor fetched, sandbox runs the restorer */
#define SF_CLONE_STAMP_RESTORER_RUNNING 15 /* host: clone mapped, its userfaultfd handed over */
#define SF_CLONE_STAMP_FIRST_PAGE 16      /* host: first page from the page server installed */
#define SF_DIST_UNKNOWN 0
#define SF_DIST_MULTICAST 1
#define SF_DIST_MULTICAST_PUSH 2
#define SF_DIST_UNICAST 3          /* STARLING_MCDIST=off */
#define SF_DIST_UNICAST_FALLBACK 4 /* multicast did not work: fell back */
/* What the parent's host sent for the ticket (sender-side counters of its
 * TCP page server and multicast sender, valid after sf_clone, also after
 * sf_join): which = SF_STAT_* below. -1 if unknown. */
long long sf_ticket_stat(const sf_ticket_t *t, int which);
#define SF_STAT_BYTES_WIRE 0      /* TCP + multicast bytes, IP/UDP/TCP headers included */
#define SF_STAT_BYTES_TCP 1
#define SF_STAT_BYTES_MULTICAST 2
#define SF_STAT_PAGES_REQUESTED 3 /* pages clones asked for (TCP + multicast) */
#define SF_STAT_PAGES_SERVED 4    /* pages sent (pushed ones included) */
#define SF_STAT_RATE_CUTS 5       /* multicast rate cuts on implicit loss */
#define SF_STAT_IMPLICIT_LOSSES 6
#define SF_STAT_LOCKSTEP_SUPPRESSED 7
#define SF_STAT_PAGES_PUSHED 8
#define SF_STAT_RATE_MIN 9        /* lowest multicast rate limit, bytes/s */
#define SF_STAT_RATE_NOW 10
#define SF_STAT_DESCRIPTOR_PAGES_SENT 11 /* descriptor pages sent: hosts fetch it like a page */
#define SF_STAT_MC_DATA_PAGES 12     /* multicast pages sent with data */
#define SF_STAT_MC_DATA_DATAGRAMS 13 /* ... and the datagrams they took (= pages when a page fits the MTU) */
#define SF_STAT_MC_MTU 14            /* the MTU the multicast sender split pages to (its link's) */
#define SF_STAT_MC_RECEIVERS 15      /* multicast receivers that joined: one per clone host (its clones share it) */
/* Size in bytes of the encoded process descriptor of the ticket's clone. */
long long sf_descriptor_bytes(const sf_ticket_t *t);
/* Free a ticket (kills its clones if they were not joined). */
void sf_release_ticket(sf_ticket_t *t);
/* What became of clone id: SF_CLONE_RUNNING (or unknown id), _EXITED,
 * _KILLED (by a signal), _LOST (host or head lost: no result, nothing
 * committed); -1 for a NULL ticket. */
#define SF_CLONE_RUNNING 0
#define SF_CLONE_EXITED 1
#define SF_CLONE_KILLED 2
#define SF_CLONE_LOST 3
int sf_clone_state(const sf_ticket_t *t, int id);
/* Hosts of the ticket's grant that cannot enforce the ticket's own network
 * (fork.isolate_network = on, the default: their clones run with the host's
 * whole network; sf_request_ticket also says so on stderr). Returns how many
 * (0: every clone is fenced, the ticket opted out, or the local backend), -1
 * for a NULL ticket. Host i (0-based) is copied into buf as "NAME\tWHY", cut
 * to len - 1 bytes and NUL-terminated; buf is left alone when i is out of
 * range, buf is NULL or len is 0. So sf_ticket_unisolated(t, 0, NULL, 0)
 * counts them. With `required` such hosts are never granted. */
int sf_ticket_unisolated(const sf_ticket_t *t, int i, char *buf, size_t len);
/* The parent's host address (IP) as clones reach it, for connecting back
 * (also in the clones' environment as STARLING_PARENT_HOST). Valid in the
 * parent after a cluster ticket and in its clones; NULL otherwise. */
const char *sf_parent_host(void);

#ifdef __cplusplus
}
#endif
#endif
