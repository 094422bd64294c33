#!/bin/sh
# One-shot set-up of the local MinIO: the `setup` service of docker-compose.yml runs
# it in the minio/mc image, after the `policies` service has written one IAM policy
# document per role (python -m infra.bucket policies) into $POLICIES_DIR. Safe to run
# again: every step creates or updates.
#
#   1. the buckets (runs, MLflow artifacts);
#   2. the lifecycle: MinIO refuses S3's AbortIncompleteMultipartUpload rule and
#      aborts stale multipart uploads itself, after api.stale_uploads_expiry, which
#      is set here; with DILOCO_EXPIRE_DAYS, runs also expire after that many days;
#   3. one MinIO user per role, each with only its role's policy: viewer,
#      launcher, aggregator, and a worker per region (user = the worker's name),
#      plus `mlflow` (the tracking server: its bucket only). The root user is used
#      here and nowhere else.
#
# Everything comes from the environment (compose passes it from .env). Every user's
# password and policy document is checked before anything is created.
set -eu

: "${MINIO_URL:?}" "${MINIO_ROOT_USER:?}" "${MINIO_ROOT_PASSWORD:?}"
: "${DILOCO_BUCKET:?}" "${DILOCO_PREFIX:?}" "${DILOCO_WORKERS:?}" "${MLFLOW_BUCKET:?}"
: "${POLICIES_DIR:?}" "${DILOCO_ABORT_MULTIPART_HOURS:?}"
EXPIRE_DAYS="${DILOCO_EXPIRE_DAYS:-}"

# The variable holding a user's password: REGION_A_PASSWORD for region-a.
password_var() { printf '%s_PASSWORD' "$(printf '%s' "$1" | tr 'a-z-' 'A-Z_')"; }
password_of() { eval "printf '%s' \"\${$(password_var "$1"):-}\""; }

mlflow_policy="$(mktemp)"
trap 'rm -f "$mlflow_policy"' EXIT
cat > "$mlflow_policy" <<POLICY
{"Version": "2012-10-17", "Statement": [
  {"Effect": "Allow", "Action": ["s3:ListBucket", "s3:GetBucketLocation"],
   "Resource": ["arn:aws:s3:::$MLFLOW_BUCKET"]},
  {"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
   "Resource": ["arn:aws:s3:::$MLFLOW_BUCKET/*"]}]}
POLICY

# Every user, its policy and the policy's document, one per line.
users="$(
    for role in viewer launcher aggregator; do
        echo "$role diloco-$role $POLICIES_DIR/$role.json"
    done
    for worker in $(printf '%s' "$DILOCO_WORKERS" | tr ',' ' '); do
        echo "$worker diloco-worker-$worker $POLICIES_DIR/worker-$worker.json"
    done
    echo "mlflow diloco-mlflow $mlflow_policy"
)"

echo "$users" | while read -r user policy file; do
    if [ ! -f "$file" ]; then
        echo "setup: no policy document $file for user $user (the policies service" \
             "writes one per role and per worker of DILOCO_WORKERS)" >&2
        exit 2
    fi
    secret="$(password_of "$user")"
    if [ "${#secret}" -lt 8 ]; then
        echo "setup: $(password_var "$user"), the password of MinIO user $user, must be" \
             "set in .env with 8 characters or more (e.g. openssl rand -hex 16)" >&2
        exit 2
    fi
done

mc alias set local "$MINIO_URL" "$MINIO_ROOT_USER" "$MINIO_ROOT_PASSWORD" >/dev/null

mc mb --ignore-existing "local/$DILOCO_BUCKET" "local/$MLFLOW_BUCKET"

mc admin config set local api "stale_uploads_expiry=${DILOCO_ABORT_MULTIPART_HOURS}h" >/dev/null
echo "stale multipart uploads aborted after ${DILOCO_ABORT_MULTIPART_HOURS} h"
if [ -n "$EXPIRE_DAYS" ]; then
    printf '{"Rules": [{"ID": "diloco-expire-runs", "Status": "Enabled", "Filter": {"Prefix": "%s/"}, "Expiration": {"Days": %s}}]}\n' \
        "$DILOCO_PREFIX" "$EXPIRE_DAYS" | mc ilm rule import "local/$DILOCO_BUCKET" >/dev/null
    echo "runs under $DILOCO_BUCKET/$DILOCO_PREFIX/ expire after $EXPIRE_DAYS days"
fi

# The user, the policy (created or updated), attached unless an earlier run did.
echo "$users" | while read -r user policy file; do
    mc admin policy create local "$policy" "$file" >/dev/null
    mc admin user add local "$user" "$(password_of "$user")" >/dev/null
    case "$(mc admin user info local "$user")" in
        *"$policy"*) ;;
        *) mc admin policy attach local "$policy" --user "$user" >/dev/null ;;
    esac
    echo "user $user: policy $policy"
done

echo "MinIO ready: s3://$DILOCO_BUCKET/$DILOCO_PREFIX, one user per role"
