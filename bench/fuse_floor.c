/*
 * fuse_floor: the least a FUSE daemon costs on this machine, as a baseline for bench/hot_path.py --floor.
 *
 * A passthrough of SOURCE at MOUNTPOINT in C on libfuse3's low-level API, with the kernel settings tierfs uses
 * (writeback cache, keep_cache, the same attr/entry timeout; read-ahead and max_background are set by the bench
 * after mounting, as tierfs sets them). What a workload loses on it against the native disk is FUSE's own cost:
 * the kernel's FUSE paths plus the least a request loop can add. What tierfs loses against it is tierfs's:
 * the Python request loop (pyfuse3 + trio) and the engine. Two reply modes:
 *   (default) pread into a buffer, then fuse_reply_buf: one copy into the kernel, as pyfuse3 replies;
 *   --splice  fuse_reply_data from the file: libfuse splices the bytes through a pipe instead, which tells
 *             whether a binding with a spliced reply would save anything.
 * Inodes are O_PATH fds counted by lookups and dropped at FORGET (unlinked files give their space back).
 *
 * Two options give it what tierfs does beside passing requests through, so a ratio to it measures only Python:
 *   --write-prime KB  tierfs's write primer (tierfs/tier/primer.py, the FUSE front's _page_read_by_writer): the
 *             second small READ in a row on a writable handle, < 1 s after the first, at the offset where the
 *             last one ended, makes a helper process posix_fadvise(WILLNEED) the next KB KiB of the file through
 *             the mount, so a writer filling a preallocated file page by page (a ConsumeQueue) finds its next
 *             pages uptodate instead of waiting for a READ per 4 KiB. Same trigger, window, process, best effort:
 *             requests go over a non-blocking pipe and a full pipe drops one (tierfs: a queue of 256).
 *   --hole-reads  READs of 64 KiB or more answer the part that is a hole in the source (SEEK_DATA) with zeros,
 *             without reading the source (tierfs.fs.localread): what the primer's and mmap faults' READs cost.
 *
 *   cc -O2 -o fuse_floor fuse_floor.c $(pkg-config --cflags --libs fuse3)
 *   fuse_floor [--splice] [--no-writeback] [--timeout S] [--threads N] [--write-prime KB] [--hole-reads]
 *              SOURCE MOUNTPOINT
 */
#define _GNU_SOURCE
#define FUSE_USE_VERSION 312

#include <fuse_lowlevel.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

struct inode {
	int fd; /* O_PATH */
	dev_t dev;
	ino_t ino;
	uint64_t nlookup;
	char *path; /* relative to SOURCE, by the last lookup or rename (only with --write-prime) */
	struct inode *prev, *next;
};

static struct inode root = { .fd = -1, .path = "", .prev = &root, .next = &root };
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;
static double timeout = 1.0;
static int use_splice, writeback = 1, hole_reads;

#define LARGE_READ (64 << 10)   /* tierfs.fs.localread.LARGE: smaller READs are one plain pread */
#define PRIME_GAP_SECONDS 1.0   /* tierfs.fs.operations.PRIME_GAP_SECONDS */

/* The write primer (--write-prime): per writable handle (indexed by its fd) where the next small READ of a
 * sequential writer is due and when the last one came; the pipe to the helper process. */
struct prime_state {
	int on;
	off_t expect;
	double last;
};
static size_t prime_window;
static struct prime_state *prime_of;
static size_t prime_len;
static pthread_mutex_t prime_lock = PTHREAD_MUTEX_INITIALIZER;
static int prime_pipe = -1;
static pid_t primer_pid = -1;
static unsigned long prime_requests, prime_dropped;

static struct inode *inode_of(fuse_ino_t ino)
{
	return ino == FUSE_ROOT_ID ? &root : (struct inode *)(uintptr_t)ino;
}

static void proc_path(char *buf, int fd)
{
	snprintf(buf, 64, "/proc/self/fd/%d", fd);
}

/* With table_lock held: i's path is now parent/name (best effort: without memory it keeps the old one). */
static void set_path(struct inode *i, struct inode *parent, const char *name)
{
	if (!parent->path)
		return;
	size_t n = strlen(parent->path) + strlen(name) + 2;
	char *p = malloc(n);
	if (!p)
		return;
	snprintf(p, n, "%s%s%s", parent->path, *parent->path ? "/" : "", name);
	if (i->path && strcmp(i->path, p) == 0) {
		free(p);
		return;
	}
	free(i->path);
	i->path = p;
}

/* Find or add the inode of parent/name; counts one lookup. Returns 0 or an errno. */
static int do_lookup(fuse_ino_t parent, const char *name, struct fuse_entry_param *e)
{
	memset(e, 0, sizeof(*e));
	e->attr_timeout = e->entry_timeout = timeout;
	int fd = openat(inode_of(parent)->fd, name, O_PATH | O_NOFOLLOW);
	if (fd < 0)
		return errno;
	if (fstatat(fd, "", &e->attr, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) < 0) {
		int err = errno;
		close(fd);
		return err;
	}
	pthread_mutex_lock(&table_lock);
	struct inode *i;
	for (i = root.next; i != &root; i = i->next)
		if (i->ino == e->attr.st_ino && i->dev == e->attr.st_dev)
			break;
	if (i != &root) {
		close(fd);
	} else {
		i = calloc(1, sizeof(*i));
		if (!i) {
			pthread_mutex_unlock(&table_lock);
			close(fd);
			return ENOMEM;
		}
		i->fd = fd;
		i->dev = e->attr.st_dev;
		i->ino = e->attr.st_ino;
		i->next = &root;
		i->prev = root.prev;
		root.prev->next = i;
		root.prev = i;
	}
	i->nlookup++;
	if (prime_window)
		set_path(i, inode_of(parent), name);
	pthread_mutex_unlock(&table_lock);
	e->ino = (uintptr_t)i;
	return 0;
}

static void forget_one(fuse_ino_t ino, uint64_t n)
{
	struct inode *i = inode_of(ino);
	if (i == &root)
		return;
	pthread_mutex_lock(&table_lock);
	i->nlookup -= n < i->nlookup ? n : i->nlookup;
	if (i->nlookup == 0) {
		i->prev->next = i->next;
		i->next->prev = i->prev;
		close(i->fd);
		free(i->path);
		free(i);
	}
	pthread_mutex_unlock(&table_lock);
}

static void ff_init(void *userdata, struct fuse_conn_info *conn)
{
	(void)userdata;
	if (writeback && (conn->capable & FUSE_CAP_WRITEBACK_CACHE))
		conn->want |= FUSE_CAP_WRITEBACK_CACHE;
	if (use_splice && (conn->capable & FUSE_CAP_SPLICE_WRITE))
		conn->want |= FUSE_CAP_SPLICE_WRITE | FUSE_CAP_SPLICE_MOVE;
}

/* The entry of parent/name after `rc`, the result of the call that made it (lookup: 0). */
static void reply_entry_or_err(fuse_req_t req, fuse_ino_t parent, const char *name, int rc)
{
	if (rc < 0) {
		fuse_reply_err(req, errno);
		return;
	}
	struct fuse_entry_param e;
	int err = do_lookup(parent, name, &e);
	if (err)
		fuse_reply_err(req, err);
	else
		fuse_reply_entry(req, &e);
}

static void ff_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
	reply_entry_or_err(req, parent, name, 0);
}

static void ff_forget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup)
{
	forget_one(ino, nlookup);
	fuse_reply_none(req);
}

static void ff_forget_multi(fuse_req_t req, size_t count, struct fuse_forget_data *forgets)
{
	for (size_t k = 0; k < count; k++)
		forget_one(forgets[k].ino, forgets[k].nlookup);
	fuse_reply_none(req);
}

static void ff_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
	(void)fi;
	struct stat st;
	if (fstatat(inode_of(ino)->fd, "", &st, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) < 0)
		fuse_reply_err(req, errno);
	else
		fuse_reply_attr(req, &st, timeout);
}

static void ff_setattr(fuse_req_t req, fuse_ino_t ino, struct stat *attr, int valid, struct fuse_file_info *fi)
{
	int ifd = inode_of(ino)->fd;
	char path[64];
	proc_path(path, ifd);
	int rc = 0;
	if (valid & FUSE_SET_ATTR_MODE)
		rc = fi ? fchmod(fi->fh, attr->st_mode) : chmod(path, attr->st_mode);
	if (!rc && (valid & (FUSE_SET_ATTR_UID | FUSE_SET_ATTR_GID)))
		rc = fchownat(ifd, "", (valid & FUSE_SET_ATTR_UID) ? attr->st_uid : (uid_t)-1,
			      (valid & FUSE_SET_ATTR_GID) ? attr->st_gid : (gid_t)-1,
			      AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW);
	if (!rc && (valid & FUSE_SET_ATTR_SIZE))
		rc = fi ? ftruncate(fi->fh, attr->st_size) : truncate(path, attr->st_size);
	if (!rc && (valid & (FUSE_SET_ATTR_ATIME | FUSE_SET_ATTR_MTIME))) {
		struct timespec tv[2] = { { .tv_nsec = UTIME_OMIT }, { .tv_nsec = UTIME_OMIT } };
		if (valid & FUSE_SET_ATTR_ATIME_NOW)
			tv[0].tv_nsec = UTIME_NOW;
		else if (valid & FUSE_SET_ATTR_ATIME)
			tv[0] = attr->st_atim;
		if (valid & FUSE_SET_ATTR_MTIME_NOW)
			tv[1].tv_nsec = UTIME_NOW;
		else if (valid & FUSE_SET_ATTR_MTIME)
			tv[1] = attr->st_mtim;
		rc = fi ? futimens(fi->fh, tv) : utimensat(AT_FDCWD, path, tv, 0);
	}
	if (rc < 0)
		fuse_reply_err(req, errno);
	else
		ff_getattr(req, ino, fi);
}


static void ff_mkdir(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode)
{
	reply_entry_or_err(req, parent, name, mkdirat(inode_of(parent)->fd, name, mode));
}

static void ff_symlink(fuse_req_t req, const char *link, fuse_ino_t parent, const char *name)
{
	reply_entry_or_err(req, parent, name, symlinkat(link, inode_of(parent)->fd, name));
}

static void ff_readlink(fuse_req_t req, fuse_ino_t ino)
{
	char buf[PATH_MAX + 1];
	ssize_t n = readlinkat(inode_of(ino)->fd, "", buf, sizeof(buf) - 1);
	if (n < 0) {
		fuse_reply_err(req, errno);
		return;
	}
	buf[n] = 0;
	fuse_reply_readlink(req, buf);
}

static void ff_unlink(fuse_req_t req, fuse_ino_t parent, const char *name)
{
	fuse_reply_err(req, unlinkat(inode_of(parent)->fd, name, 0) < 0 ? errno : 0);
}

static void ff_rmdir(fuse_req_t req, fuse_ino_t parent, const char *name)
{
	fuse_reply_err(req, unlinkat(inode_of(parent)->fd, name, AT_REMOVEDIR) < 0 ? errno : 0);
}

static void ff_rename(fuse_req_t req, fuse_ino_t parent, const char *name, fuse_ino_t newparent,
		      const char *newname, unsigned int flags)
{
	int rc = renameat2(inode_of(parent)->fd, name, inode_of(newparent)->fd, newname, flags);
	struct stat st;
	if (rc == 0 && prime_window &&
	    fstatat(inode_of(newparent)->fd, newname, &st, AT_SYMLINK_NOFOLLOW) == 0) {
		pthread_mutex_lock(&table_lock);
		for (struct inode *i = root.next; i != &root; i = i->next)
			if (i->ino == st.st_ino && i->dev == st.st_dev) {
				set_path(i, inode_of(newparent), newname);
				break;
			}
		pthread_mutex_unlock(&table_lock);
	}
	fuse_reply_err(req, rc < 0 ? errno : 0);
}

/* With the writeback cache the kernel reads to fill partial pages and does O_APPEND itself. */
static int backing_flags(int flags)
{
	if (writeback) {
		if ((flags & O_ACCMODE) == O_WRONLY)
			flags = (flags & ~O_ACCMODE) | O_RDWR;
		flags &= ~O_APPEND;
	}
	return flags & ~O_NOFOLLOW;
}

/* A handle opened (or, with O_RDONLY, released): a writable one is watched for a writer's page reads. */
static void prime_opened(int fd, int flags)
{
	if (!prime_window || fd < 0 || (size_t)fd >= prime_len)
		return;
	pthread_mutex_lock(&prime_lock);
	prime_of[fd] = (struct prime_state){ .on = (flags & O_ACCMODE) != O_RDONLY, .expect = -1, .last = 0.0 };
	pthread_mutex_unlock(&prime_lock);
}

static void ff_create(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode, struct fuse_file_info *fi)
{
	int fd = openat(inode_of(parent)->fd, name, backing_flags(fi->flags) | O_CREAT, mode);
	if (fd < 0) {
		fuse_reply_err(req, errno);
		return;
	}
	struct fuse_entry_param e;
	int err = do_lookup(parent, name, &e);
	if (err) {
		close(fd);
		fuse_reply_err(req, err);
		return;
	}
	fi->fh = fd;
	fi->keep_cache = 1;
	prime_opened(fd, fi->flags);
	if (fuse_reply_create(req, &e, fi) != 0) {
		close(fd);
		forget_one(e.ino, 1);
	}
}

static void ff_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
	char path[64];
	proc_path(path, inode_of(ino)->fd);
	int fd = open(path, backing_flags(fi->flags));
	if (fd < 0) {
		fuse_reply_err(req, errno);
		return;
	}
	fi->fh = fd;
	fi->keep_cache = 1;
	prime_opened(fd, fi->flags);
	if (fuse_reply_open(req, fi) != 0)
		close(fd);
}

/* pwrite (write) or pread all `size` bytes, short only at EOF; -errno on failure. */
static ssize_t io_full(int write, int fd, char *buf, size_t size, off_t off)
{
	size_t done = 0;
	while (done < size) {
		ssize_t n = write ? pwrite(fd, buf + done, size - done, off + done)
				  : pread(fd, buf + done, size - done, off + done);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			return -errno;
		if (n == 0)
			break;
		done += n;
	}
	return done;
}

/* How many bytes from `off` (at most `size`) are a hole of fd (SEEK_DATA finds no data there); 0 if unknown. */
static size_t hole_prefix(int fd, off_t off, size_t size)
{
	off_t data = lseek(fd, off, SEEK_DATA), hole;
	if (data < 0) {
		struct stat st;
		if (errno != ENXIO || fstat(fd, &st) < 0)
			return 0;
		hole = st.st_size - off; /* no data at or after off: a hole to the end */
	} else {
		hole = data - off;
	}
	return hole <= 0 ? 0 : (size_t)hole < size ? (size_t)hole : size;
}

/* Ask the primer process for `prime_window` bytes of `path` from `off`; a full pipe drops the request. */
static void prime_want(const char *path, off_t off)
{
	char rec[PIPE_BUF];
	int n = snprintf(rec, sizeof(rec), "%s\t%lld\t%zu", path, (long long)off, prime_window);
	if (n < 0 || (size_t)n + 1 > sizeof(rec))
		return;
	if (write(prime_pipe, rec, n + 1) == n + 1)
		__atomic_add_fetch(&prime_requests, 1, __ATOMIC_RELAXED);
	else
		__atomic_add_fetch(&prime_dropped, 1, __ATOMIC_RELAXED);
}

/* A small READ on a handle: on a writable one, the kernel filling a page before a partial write into it. The
 * second one in a row, less than PRIME_GAP_SECONDS after the first, primes the next window; the one after that
 * window primes again (tierfs.fs.operations._page_read_by_writer, line for line). */
static void page_read_by_writer(fuse_ino_t ino, int fh, off_t off, size_t size)
{
	if (!prime_window || fh < 0 || (size_t)fh >= prime_len)
		return;
	char *path = NULL;
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	double now = ts.tv_sec + ts.tv_nsec / 1e9;
	off_t end = off + size, at = end;
	pthread_mutex_lock(&prime_lock);
	struct prime_state *p = &prime_of[fh];
	if (!p->on) {
		pthread_mutex_unlock(&prime_lock);
		return;
	}
	if (off == p->expect && size && now - p->last < PRIME_GAP_SECONDS) {
		pthread_mutex_lock(&table_lock);
		struct inode *i = inode_of(ino);
		path = i->path && *i->path ? strdup(i->path) : NULL;
		pthread_mutex_unlock(&table_lock);
		if (path)
			end += prime_window;
	}
	p->expect = end;
	p->last = now;
	pthread_mutex_unlock(&prime_lock);
	if (path) {
		prime_want(path, at);
		free(path);
	}
}

/* The primer process: `path<TAB>offset<TAB>length<NUL>` records from `in` until it closes; each one opens the
 * path through the mount, advises WILLNEED and closes it again (tierfs.tier.primer.main). Forked before the
 * session exists, so it never holds the /dev/fuse fd: a killed floor still aborts its connection. */
static void primer_main(int in, const char *mountpoint)
{
	static char buf[1 << 16];
	size_t have = 0;
	prctl(PR_SET_PDEATHSIG, SIGKILL);
	for (;;) {
		ssize_t n = read(in, buf + have, sizeof(buf) - have);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			_exit(0);
		have += n;
		char *rec = buf, *nul;
		while ((nul = memchr(rec, 0, buf + have - rec))) {
			char *t2 = strrchr(rec, '\t'), *t1;
			if (t2) {
				*t2 = 0;
				t1 = strrchr(rec, '\t');
				if (t1) {
					*t1 = 0;
					char path[PATH_MAX];
					int len = snprintf(path, sizeof(path), "%s/%s", mountpoint, rec);
					int fd = len > 0 && (size_t)len < sizeof(path)
							 ? open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK) : -1;
					if (fd >= 0) {
						posix_fadvise(fd, atoll(t1 + 1), atoll(t2 + 1), POSIX_FADV_WILLNEED);
						close(fd);
					}
				}
			}
			rec = nul + 1;
		}
		have = buf + have - rec;
		memmove(buf, rec, have);
		if (have == sizeof(buf))
			have = 0; /* a record longer than the buffer: drop it */
	}
}

/* Start the primer process and the handle table (--write-prime). Returns 0 or -1. */
static int primer_start(const char *mountpoint)
{
	static char mp[PATH_MAX];
	if (!realpath(mountpoint, mp))
		return -1;
	struct rlimit rl;
	prime_len = getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < (1 << 22)
			    ? rl.rlim_cur : (1 << 16);
	prime_of = calloc(prime_len, sizeof(*prime_of));
	int fds[2];
	if (!prime_of || pipe2(fds, O_CLOEXEC) < 0)
		return -1;
	primer_pid = fork();
	if (primer_pid < 0)
		return -1;
	if (primer_pid == 0) {
		close(fds[1]);
		close(root.fd);
		primer_main(fds[0], mp);
	}
	close(fds[0]);
	prime_pipe = fds[1];
	return fcntl(prime_pipe, F_SETFL, O_NONBLOCK);
}

static void primer_stop(void)
{
	if (primer_pid <= 0)
		return;
	close(prime_pipe); /* end of input: it exits, and is reaped so its CPU shows in ours (cutime) */
	waitpid(primer_pid, NULL, 0);
	fprintf(stderr, "fuse_floor: write primer: %lu requests, %lu dropped\n", prime_requests, prime_dropped);
}

static void ff_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
	if (use_splice) {
		struct fuse_bufvec v = FUSE_BUFVEC_INIT(size);
		v.buf[0].flags = FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK;
		v.buf[0].fd = fi->fh;
		v.buf[0].pos = off;
		fuse_reply_data(req, &v, FUSE_BUF_SPLICE_MOVE);
		if (size < LARGE_READ) /* a page READ inside a preallocated file: all of it is there */
			page_read_by_writer(ino, fi->fh, off, size);
		return;
	}
	size_t hole = hole_reads && size >= LARGE_READ ? hole_prefix(fi->fh, off, size) : 0;
	char *buf = hole ? calloc(1, size) : malloc(size ? size : 1);
	if (!buf) {
		fuse_reply_err(req, ENOMEM);
		return;
	}
	ssize_t got = hole == size ? 0 : io_full(0, fi->fh, buf + hole, size - hole, off + hole);
	if (got < 0) {
		fuse_reply_err(req, -got);
	} else {
		fuse_reply_buf(req, buf, got + hole);
		if (size < LARGE_READ)
			page_read_by_writer(ino, fi->fh, off, got);
	}
	free(buf);
}

static void ff_write(fuse_req_t req, fuse_ino_t ino, const char *buf, size_t size, off_t off,
		     struct fuse_file_info *fi)
{
	(void)ino;
	ssize_t done = io_full(1, fi->fh, (char *)buf, size, off);
	if (done < 0)
		fuse_reply_err(req, -done);
	else
		fuse_reply_write(req, done);
}

static void ff_flush(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
	(void)ino;
	fuse_reply_err(req, close(dup(fi->fh)) < 0 ? errno : 0);
}

static void ff_release(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
	(void)ino;
	prime_opened(fi->fh, O_RDONLY);
	close(fi->fh);
	fuse_reply_err(req, 0);
}

static void ff_fsync(fuse_req_t req, fuse_ino_t ino, int datasync, struct fuse_file_info *fi)
{
	(void)ino;
	int rc = datasync ? fdatasync(fi->fh) : fsync(fi->fh);
	fuse_reply_err(req, rc < 0 ? errno : 0);
}

struct dir {
	DIR *dp;
	struct dirent *entry;
	off_t offset;
};

static void ff_opendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
	struct dir *d = calloc(1, sizeof(*d));
	int fd = openat(inode_of(ino)->fd, ".", O_RDONLY | O_DIRECTORY);
	if (!d || fd < 0 || !(d->dp = fdopendir(fd))) {
		int err = d ? errno : ENOMEM;
		if (fd >= 0)
			close(fd);
		free(d);
		fuse_reply_err(req, err);
		return;
	}
	fi->fh = (uintptr_t)d;
	if (fuse_reply_open(req, fi) != 0) {
		closedir(d->dp);
		free(d);
	}
}

static void ff_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
	(void)ino;
	struct dir *d = (struct dir *)(uintptr_t)fi->fh;
	char *buf = calloc(1, size), *p = buf;
	size_t left = size;
	if (!buf) {
		fuse_reply_err(req, ENOMEM);
		return;
	}
	if (off != d->offset) {
		seekdir(d->dp, off);
		d->entry = NULL;
		d->offset = off;
	}
	for (;;) {
		if (!d->entry) {
			errno = 0;
			d->entry = readdir(d->dp);
			if (!d->entry) {
				if (errno && p == buf) {
					fuse_reply_err(req, errno);
					free(buf);
					return;
				}
				break;
			}
		}
		struct stat st = { .st_ino = d->entry->d_ino, .st_mode = d->entry->d_type << 12 };
		off_t next = telldir(d->dp);
		size_t n = fuse_add_direntry(req, p, left, d->entry->d_name, &st, next);
		if (n > left)
			break;
		p += n;
		left -= n;
		d->entry = NULL;
		d->offset = next;
	}
	fuse_reply_buf(req, buf, size - left);
	free(buf);
}

static void ff_releasedir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
	(void)ino;
	struct dir *d = (struct dir *)(uintptr_t)fi->fh;
	closedir(d->dp);
	free(d);
	fuse_reply_err(req, 0);
}

static void ff_statfs(fuse_req_t req, fuse_ino_t ino)
{
	struct statvfs sv;
	if (fstatvfs(inode_of(ino)->fd, &sv) < 0)
		fuse_reply_err(req, errno);
	else
		fuse_reply_statfs(req, &sv);
}

static const struct fuse_lowlevel_ops ops = {
	.init = ff_init,
	.lookup = ff_lookup,
	.forget = ff_forget,
	.forget_multi = ff_forget_multi,
	.getattr = ff_getattr,
	.setattr = ff_setattr,
	.readlink = ff_readlink,
	.mkdir = ff_mkdir,
	.symlink = ff_symlink,
	.unlink = ff_unlink,
	.rmdir = ff_rmdir,
	.rename = ff_rename,
	.create = ff_create,
	.open = ff_open,
	.read = ff_read,
	.write = ff_write,
	.flush = ff_flush,
	.release = ff_release,
	.fsync = ff_fsync,
	.opendir = ff_opendir,
	.readdir = ff_readdir,
	.releasedir = ff_releasedir,
	.statfs = ff_statfs,
};

static int usage(void)
{
	fprintf(stderr, "usage: fuse_floor [--splice] [--no-writeback] [--timeout S] [--threads N] [--write-prime KB] "
			"[--hole-reads] SOURCE MOUNTPOINT\n");
	return 2;
}

int main(int argc, char **argv)
{
	int threads = 16, k;
	for (k = 1; k < argc && strncmp(argv[k], "--", 2) == 0; k++) {
		if (!strcmp(argv[k], "--splice"))
			use_splice = 1;
		else if (!strcmp(argv[k], "--no-writeback"))
			writeback = 0;
		else if (!strcmp(argv[k], "--timeout") && k + 1 < argc)
			timeout = atof(argv[++k]);
		else if (!strcmp(argv[k], "--threads") && k + 1 < argc)
			threads = atoi(argv[++k]);
		else if (!strcmp(argv[k], "--write-prime") && k + 1 < argc)
			prime_window = (size_t)atoll(argv[++k]) << 10;
		else if (!strcmp(argv[k], "--hole-reads"))
			hole_reads = 1;
		else
			return usage();
	}
	if (argc - k != 2)
		return usage();
	const char *source = argv[k], *mountpoint = argv[k + 1];
	root.fd = open(source, O_PATH | O_DIRECTORY);
	if (root.fd < 0) {
		perror(source);
		return 1;
	}
	root.nlookup = 2;
	if (prime_window && primer_start(mountpoint) != 0) {
		perror("write primer");
		return 1;
	}

	char fsname[PATH_MAX + 16];
	snprintf(fsname, sizeof(fsname), "-ofsname=%s,subtype=floor,default_permissions", source);
	char *fargv[] = { argv[0], fsname, NULL };
	struct fuse_args args = FUSE_ARGS_INIT(2, fargv);
	struct fuse_session *se = fuse_session_new(&args, &ops, sizeof(ops), NULL);
	if (!se)
		return 1;
	if (fuse_set_signal_handlers(se) != 0 || fuse_session_mount(se, mountpoint) != 0) {
		fuse_session_destroy(se);
		return 1;
	}
	struct fuse_loop_config *cfg = fuse_loop_cfg_create();
	fuse_loop_cfg_set_clone_fd(cfg, 0);
	fuse_loop_cfg_set_max_threads(cfg, threads);
	int rc = fuse_session_loop_mt(se, cfg);
	fuse_loop_cfg_destroy(cfg);
	fuse_session_unmount(se);
	fuse_remove_signal_handlers(se);
	fuse_session_destroy(se);
	primer_stop();
	return rc ? 1 : 0;
}
