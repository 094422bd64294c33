"""Infrastructure: what a user sets up around the training path, shipped beside it.

- bucket administration: `infra.setup` (``diloco bucket setup``), `infra.bucket`
  (create, lifecycle, the per-role policy documents derived from
  `storage.layout.KEYS`; ``python -m infra.bucket``), `infra.iam` (what a document
  allows, as IAM judges it);
- the Prefect deployments and work-pool templates (prefect.yaml, pools/);
- the local stack (minio/).

The training path (storage, diloco, workers, tracking, flows) never imports this
package; the ``diloco`` command does, for its ``bucket`` and ``deploy`` commands.
"""
