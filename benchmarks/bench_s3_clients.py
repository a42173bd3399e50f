"""Compare S3 clients on a local SeaweedFS server (tests/_s3server.py).

Same bytes (held in memory), same server, interleaved repetitions, medians:

* boto3-parts        explicit create_multipart_upload / upload_part (from a
                     ThreadPoolExecutor, bodies are zero-copy readers over a
                     memoryview slice) / complete; ranged GETs readinto() one
                     preallocated bytearray.
* boto3-parts-nocrc  the same with Config(request_checksum_calculation=
                     "when_required", response_checksum_validation=
                     "when_required"): no CRC32 "flexible checksum" per part.
* boto3-transfer     s3transfer upload_fileobj / download_fileobj with a
                     TransferConfig of the same part size and threads.
* obstore            obstore.put(chunk_size=part, max_concurrency=threads);
                     parallel get_range() per part copied into the bytearray.
* obstore-unsigned   the same with unsigned_payload=True (no SHA-256 of the
                     body for the SigV4 signature).

Over plain http botocore always SHA-256-signs the payload (it only sends
UNSIGNED-PAYLOAD over https), so every boto3 row includes a SHA-256 pass over
the data; obstore does too unless unsigned_payload=True.

Client CPU is process time of this process; server CPU is the weed
process's utime+stime from /proc.  Both share the machine's cores.

    .venv/bin/python benchmarks/bench_s3_clients.py [--size MiB] [--reps N]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from _s3server import SeaweedServer  # noqa: E402

MiB = 1 << 20


class ViewReader(io.RawIOBase):
    """A seekable, read-only file over a memoryview that hands out slices
    of it (no copy): what botocore hashes and http.client sends."""

    def __init__(self, view: memoryview):
        self._view = view
        self._pos = 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self._pos

    def seek(self, pos, whence=0):
        base = (0, self._pos, len(self._view))[whence]
        self._pos = max(0, min(len(self._view), base + pos))
        return self._pos

    def read(self, n=-1):
        end = len(self._view) if n is None or n < 0 else min(len(self._view), self._pos + n)
        out = self._view[self._pos:end]
        self._pos = end
        return out

    def readinto(self, b):
        chunk = self.read(len(b))
        b[:len(chunk)] = chunk
        return len(chunk)

    def __len__(self):
        return len(self._view)


class BufferWriter(io.RawIOBase):
    """A seekable file writing into a preallocated bytearray."""

    def __init__(self, buf: bytearray):
        self._view = memoryview(buf)
        self._pos = 0

    def writable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self._pos

    def seek(self, pos, whence=0):
        self._pos = (0, self._pos, len(self._view))[whence] + pos
        return self._pos

    def write(self, b):
        n = len(b)
        self._view[self._pos:self._pos + n] = b
        self._pos += n
        return n


def parts_of(size, part):
    return [(i, off, min(part, size - off)) for i, off in enumerate(range(0, size, part), 1)]


# -- methods -----------------------------------------------------------------

class Boto3Parts:
    def __init__(self, server, part, threads, nocrc=False):
        kw = dict(request_checksum_calculation="when_required",
                  response_checksum_validation="when_required") if nocrc else {}
        self.client = server.client(max_pool_connections=max(10, 2 * threads), read_timeout=120, **kw)
        self.part, self.pool = part, ThreadPoolExecutor(threads)

    def upload(self, bucket, key, data: memoryview):
        c = self.client
        uid = c.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]

        def one(p):
            num, off, n = p
            r = c.upload_part(Bucket=bucket, Key=key, UploadId=uid, PartNumber=num,
                              Body=ViewReader(data[off:off + n]), ContentLength=n)
            return {"PartNumber": num, "ETag": r["ETag"]}
        done = list(self.pool.map(one, parts_of(len(data), self.part)))
        c.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=uid,
                                    MultipartUpload={"Parts": done})

    def download(self, bucket, key, out: bytearray):
        view = memoryview(out)

        def one(p):
            _, off, n = p
            body = self.client.get_object(Bucket=bucket, Key=key,
                                          Range=f"bytes={off}-{off + n - 1}")["Body"]
            got = 0
            while got < n:
                k = body.readinto(view[off + got:off + n])
                if not k:
                    raise IOError("short read")
                got += k
            body.close()
        list(self.pool.map(one, parts_of(len(out), self.part)))


class Boto3Transfer:
    def __init__(self, server, part, threads):
        from boto3.s3.transfer import TransferConfig
        self.client = server.client(max_pool_connections=max(10, 2 * threads), read_timeout=120)
        self.cfg = TransferConfig(multipart_threshold=part, multipart_chunksize=part,
                                  max_concurrency=threads, use_threads=True)

    def upload(self, bucket, key, data):
        self.client.upload_fileobj(ViewReader(data), bucket, key, Config=self.cfg)

    def download(self, bucket, key, out):
        self.client.download_fileobj(bucket, key, BufferWriter(out), Config=self.cfg)


class Obstore:
    def __init__(self, server, part, threads, unsigned=False):
        from obstore.store import S3Store
        self.server, self.part, self.threads, self.unsigned = server, part, threads, unsigned
        self.pool = ThreadPoolExecutor(threads)
        self._stores = {}
        self.S3Store = S3Store

    def store(self, bucket):
        if bucket not in self._stores:
            s = self.server
            self._stores[bucket] = self.S3Store(
                bucket, endpoint=s.endpoint, access_key_id=s.access_key,
                secret_access_key=s.secret_key, region=s.region,
                virtual_hosted_style_request=False, unsigned_payload=self.unsigned,
                client_options={"allow_http": True, "timeout": "120s"})
        return self._stores[bucket]

    def upload(self, bucket, key, data):
        import obstore
        obstore.put(self.store(bucket), key, data, chunk_size=self.part,
                    max_concurrency=self.threads)

    def download(self, bucket, key, out):
        import obstore
        view, st = memoryview(out), self.store(bucket)

        def one(p):
            _, off, n = p
            b = obstore.get_range(st, key, start=off, length=n)
            view[off:off + n] = b
        list(self.pool.map(one, parts_of(len(out), self.part)))


# -- driver -------------------------------------------------------------------

def proc_cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=512, help="MiB of data (default 512)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--part-mb", type=int, default=32)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--methods", default="boto3-parts,boto3-parts-nocrc,boto3-transfer,obstore,obstore-unsigned")
    args = ap.parse_args(argv)
    size, part = args.size * MiB, args.part_mb * MiB

    rng_block = os.urandom(64 * MiB)
    data = bytearray(size)
    for off in range(0, size, len(rng_block)):
        n = min(len(rng_block), size - off)
        data[off:off + n] = rng_block[:n]
        data[off:off + 8] = off.to_bytes(8, "little")  # blocks differ
    view = memoryview(data)
    out = bytearray(size)

    with tempfile.TemporaryDirectory(prefix="bench-s3-") as tmp, SeaweedServer(tmp) as server:
        import boto3
        import botocore
        import obstore
        makers = {
            "boto3-parts": lambda: Boto3Parts(server, part, args.threads),
            "boto3-parts-nocrc": lambda: Boto3Parts(server, part, args.threads, nocrc=True),
            "boto3-transfer": lambda: Boto3Transfer(server, part, args.threads),
            "obstore": lambda: Obstore(server, part, args.threads),
            "obstore-unsigned": lambda: Obstore(server, part, args.threads, unsigned=True),
        }
        names = args.methods.split(",")
        clients = {n: makers[n]() for n in names}
        print(f"# {args.size} MiB, parts {args.part_mb} MiB, {args.threads} threads, {args.reps} reps, "
              f"{os.cpu_count()} CPUs; boto3 {boto3.__version__} botocore {botocore.__version__} "
              f"obstore {obstore.__version__}; server: weed at {server.endpoint}", flush=True)
        res = {n: {"up": [], "down": [], "cpu_up": [], "cpu_down": [], "srv_up": [], "srv_down": []}
               for n in names}
        for rep in range(args.reps):
            for name in (names if rep % 2 == 0 else names[::-1]):
                m, r = clients[name], res[name]
                bucket = server.make_bucket()
                server.client().put_object(Bucket=bucket, Key="warm", Body=b"x")  # volume growth
                key = "obj"
                t0, c0, s0 = time.perf_counter(), time.process_time(), proc_cpu(server.proc.pid)
                m.upload(bucket, key, view)
                t1, c1, s1 = time.perf_counter(), time.process_time(), proc_cpu(server.proc.pid)
                m.download(bucket, key, out)
                t2, c2, s2 = time.perf_counter(), time.process_time(), proc_cpu(server.proc.pid)
                if out != data:
                    raise SystemExit(f"{name}: downloaded bytes differ")
                out[:64] = bytes(64)
                r["up"].append(t1 - t0); r["down"].append(t2 - t1)
                r["cpu_up"].append(c1 - c0); r["cpu_down"].append(c2 - c1)
                r["srv_up"].append(s1 - s0); r["srv_down"].append(s2 - s1)
                server.client().delete_bucket(Bucket=bucket)
                print(f"rep {rep} {name:18s} up {size / (t1 - t0) / 1e9:6.3f} GB/s  "
                      f"down {size / (t2 - t1) / 1e9:6.3f} GB/s", flush=True)

    gb = size / 1e9
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in res.items()}
    best_up = max(gb / m["up"] for m in med.values())
    best_down = max(gb / m["down"] for m in med.values())
    print()
    print(f"{'method':18s} {'up GB/s':>8s} {'/best':>6s} {'down GB/s':>9s} {'/best':>6s} "
          f"{'cli CPU s/GB up':>15s} {'down':>6s} {'srv CPU s/GB up':>15s} {'down':>6s}")
    for n in names:
        m = med[n]
        up, down = gb / m["up"], gb / m["down"]
        print(f"{n:18s} {up:8.3f} {up / best_up:6.2f} {down:9.3f} {down / best_down:6.2f} "
              f"{m['cpu_up'] / gb:15.2f} {m['cpu_down'] / gb:6.2f} "
              f"{m['srv_up'] / gb:15.2f} {m['srv_down'] / gb:6.2f}")
    print("(medians; GB = 1e9 bytes; CPU = process time, client = this process, srv = weed)")


if __name__ == "__main__":
    main()
