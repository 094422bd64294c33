"""An S3 server that enforces IAM policies: moto's (tests/s3server.py's MotoS3Server,
running this file as its child), with one IAM user per role.

moto's server checks every S3 request against the identity policies of the IAM
user whose access key signed it, once its authentication is switched on
(``/moto-api/reset-auth``, what ``INITIAL_NO_AUTH_ACTION_COUNT`` sets at start).
Users, policies and keys are made through moto's own IAM API, as on AWS. Two of
its checks differ from AWS's, and the child corrects exactly those two before it
serves (`_align_with_aws`), so that what passes here would pass on AWS:

- moto reads a ``Resource`` pattern as a regular expression with ``*`` turned
  into ``.*``: a ``.`` matches any character and a ``?`` is a quantifier. IAM has
  two wildcards, ``*`` and ``?``, and every other character is literal.
- moto authorizes a DeleteObjects request (what s3fs sends for every delete)
  against the bucket's ARN, which no per-prefix policy grants, so it denies every
  object; AWS checks ``s3:DeleteObject`` on each key. Here each key is checked;
  one denied key denies the whole request (stricter than AWS, which answers per
  key; our stores delete one owner's keys per request).

Left as moto does it: it evaluates no ``Condition`` on S3 requests, so the
``s3:prefix`` condition of ListBucket is not enforced (infra/iam.py's evaluator
checks it in tests/test_bucket.py); HeadBucket is its own action here (AWS asks
for ListBucket): the roles are denied it on both, which the store takes as "the
bucket exists" (storage.backends.bucket_found).

Usage::

    with IAMS3Server() as server:
        env = server.user("worker-a", policy_document)   # AWS_* variables for that user
        server.admin                                      # an s3:* user, to set things up
"""

from __future__ import annotations

import json
import sys
import urllib.request
from typing import Any

from s3server import REGION, MotoS3Server, _serve

ADMIN_POLICY = {"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Action": ["s3:*", "iam:*"], "Resource": "*"}]}


class IAMS3Server(MotoS3Server):
    """moto's server on 127.0.0.1 and a free port, enforcing IAM from `start` on."""

    child_script = __file__

    def __init__(self) -> None:
        super().__init__()
        self.admin: dict[str, str] = {}

    def start(self) -> str:
        super().start()
        # Before authentication is on, anyone may create the first user.
        self.admin = self._create_user("admin", ADMIN_POLICY, {"AWS_ACCESS_KEY_ID": "x",
                                                               "AWS_SECRET_ACCESS_KEY": "x"})
        self._post("/moto-api/reset-auth", b"0")  # from now on, every request is checked
        return self.endpoint_url

    def _post(self, path: str, data: bytes) -> None:
        request = urllib.request.Request(self.endpoint_url + path, data=data, method="POST",
                                         headers={"Content-Type": "text/plain"})
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=10) as answer:
            answer.read()

    def client(self, service: str, credentials: dict[str, str]) -> Any:
        import boto3

        return boto3.client(service, endpoint_url=self.endpoint_url, region_name=REGION,
                            aws_access_key_id=credentials["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=credentials["AWS_SECRET_ACCESS_KEY"])

    def _create_user(self, name: str, policy: dict[str, Any],
                     signer: dict[str, str]) -> dict[str, str]:
        iam = self.client("iam", signer)
        iam.create_user(UserName=name)
        iam.put_user_policy(UserName=name, PolicyName=name, PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return {"AWS_ACCESS_KEY_ID": key["AccessKeyId"],
                "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}

    def user(self, name: str, policy: dict[str, Any]) -> dict[str, str]:
        """Create IAM user ``name`` with ``policy`` as its only policy; returns the
        environment a process needs to act as it (keys, endpoint, region)."""
        return {**self._create_user(name, policy, self.admin),
                "AWS_ENDPOINT_URL_S3": self.endpoint_url, "AWS_DEFAULT_REGION": REGION}


class SeaweedIAMServer:
    """SeaweedFS with its IAM API writable (storage/seaweed.py): the same interface as
    `IAMS3Server`, so the role tests run on a real object store too. Its IAM
    evaluates the AWS documents itself (mid-key wildcards, ``s3:prefix``
    conditions); nothing of it is corrected here."""

    def __init__(self) -> None:
        from s3server import SeaweedS3Server

        self._served = SeaweedS3Server(iam_writable=True)
        self.admin: dict[str, str] = {}
        self.endpoint_url = ""

    def __enter__(self) -> SeaweedIAMServer:
        self.endpoint_url = self._served.start()
        self.admin = self._served.admin.env()
        return self

    def __exit__(self, *exc: object) -> None:
        self._served.stop()

    client = IAMS3Server.client

    def user(self, name: str, policy: dict[str, Any]) -> dict[str, str]:
        """As `IAMS3Server.user`, through SeaweedFS's IAM API."""
        return {**IAMS3Server._create_user(self, name, policy, self.admin),  # type: ignore[arg-type]
                "AWS_ENDPOINT_URL_S3": self.endpoint_url, "AWS_DEFAULT_REGION": REGION}


def _align_with_aws() -> None:
    """The two corrections of the module docstring, applied to moto in this process."""
    import re

    import xmltodict
    from moto.core.authorization import ActionAuthenticatorMixin
    from moto.iam.access_control import IAMPolicyStatement

    # written here, not taken from infra.iam, so that the server checks that code
    def iam_match(pattern: str, value: str) -> re.Match[str] | None:
        body = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
        return re.match(f"^{body}$", value, re.DOTALL)

    IAMPolicyStatement._match = staticmethod(iam_match)
    check = ActionAuthenticatorMixin._authenticate_and_authorize_s3_action

    def each_key(self: Any, bucket_name: str | None = None, key_name: str | None = None) -> None:
        if (key_name is None and bucket_name and self.data.get("Action") == "DeleteObject"
                and self.is_delete_keys()):
            objects = xmltodict.parse(self.body)["Delete"].get("Object", [])
            for item in objects if isinstance(objects, list) else [objects]:
                check(self, bucket_name, item["Key"])
            return
        check(self, bucket_name, key_name)

    ActionAuthenticatorMixin._authenticate_and_authorize_s3_action = each_key


if __name__ == "__main__":  # the child: moto aligned with AWS, then s3server's _serve
    _align_with_aws()
    _serve(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1")
