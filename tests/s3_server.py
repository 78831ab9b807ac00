"""A real S3-protocol server for the tests: moto's server mode in a subprocess on 127.0.0.1, with credentials
checked (an IAM user made at start, then authentication switched on), offline."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

REGION = "us-east-1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """A running moto server: its endpoint, an access key allowed everything, and a client for setting up."""

    def __init__(self, proc: subprocess.Popen, endpoint: str, key: str, secret: str) -> None:
        self.proc, self.endpoint, self.key, self.secret = proc, endpoint, key, secret

    def env(self, **over: str) -> dict[str, str]:
        """Return the AWS environment of a client of this server (no config file of the machine is read)."""
        env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.key, "AWS_SECRET_ACCESS_KEY": self.secret,
               "AWS_DEFAULT_REGION": REGION, "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
               "AWS_EC2_METADATA_DISABLED": "true"}
        env.update(over)
        return env

    def client(self):
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3", region_name=REGION, endpoint_url=self.endpoint, aws_access_key_id=self.key,
            aws_secret_access_key=self.secret)

    def bucket(self) -> str:
        """Return the name of a new, empty bucket."""
        name = f"t-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str) -> dict[str, bytes]:
        """Return every object of a bucket: key -> bytes."""
        c, out = self.client(), {}
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for o in page.get("Contents", []):
                out[o["Key"]] = c.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_server(timeout: float = 30.0, auth: bool = True) -> S3Server:
    """Return a started moto server (auth: credentials checked); RuntimeError (with why) if it cannot start here."""
    import botocore.session

    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).read()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"moto server did not start on {endpoint}") from None
            time.sleep(0.2)
    if not auth:
        return S3Server(proc, endpoint, "any", "any")
    iam = botocore.session.get_session().create_client("iam", region_name=REGION, endpoint_url=endpoint,
                                                        aws_access_key_id="setup", aws_secret_access_key="setup")
    iam.create_user(UserName="dflash")
    iam.put_user_policy(UserName="dflash", PolicyName="all", PolicyDocument=(
        '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}'))
    key = iam.create_access_key(UserName="dflash")["AccessKey"]
    # From now on every request is authenticated: a wrong key or secret is refused as by AWS.
    urllib.request.urlopen(urllib.request.Request(endpoint + "/moto-api/reset-auth", data=b"0", method="POST",
                                                  headers={"Content-Type": "text/plain"})).read()
    return S3Server(proc, endpoint, key["AccessKeyId"], key["SecretAccessKey"])


def start_forgetful_proxy(upstream: str):
    """Return (a running HTTP server forwarding to upstream without the If-None-Match header, its URL): an S3
    server that ignores conditional creates, as some S3-compatible servers do."""
    import http.client
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import urlsplit

    host = urlsplit(upstream).netloc

    class Forward(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # answers a client's `Expect: 100-continue` (botocore sends one with a PUT)

        def _forward(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("if-none-match", "expect")}
            conn = http.client.HTTPConnection(host, timeout=30)
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _forward

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Forward)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"
