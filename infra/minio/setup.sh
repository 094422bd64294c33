#!/bin/sh
# One-shot set-up of the stack's S3 service: the `setup` service (MinIO, in the
# minio/mc image) and the `setup-seaweedfs` service (SeaweedFS, in the project image)
# of docker-compose.yml both run it, after the `policies` service has written one IAM
# policy document per role (python -m infra.bucket policies) into $POLICIES_DIR.
# Safe to run again: every step creates or updates.
#
#   1. the buckets (runs, MLflow artifacts);
#   2. the lifecycle: MinIO refuses S3's AbortIncompleteMultipartUpload rule and
#      aborts stale multipart uploads itself, after api.stale_uploads_expiry, which
#      is set here; with DILOCO_EXPIRE_DAYS, runs also expire after that many days
#      (MinIO only: SeaweedFS keeps runs until they are deleted, `diloco gc`);
#   3. one user per role, each with only its role's policy: viewer, launcher,
#      aggregator, and a worker per region (user = the worker's name), plus `mlflow`
#      (the tracking server: its bucket only). The root user is used here and
#      nowhere else;
#   4. each user's keys, with the S3 endpoint, in $CREDENTIALS_DIR/<user>/env (a
#      volume per user, which only that user's service mounts). On MinIO a user's
#      secret is its password from .env; SeaweedFS's IAM API makes the keys
#      (python -m infra.iam_users), and the passwords are not used.
#
# Everything comes from the environment (compose passes it from .env). On MinIO every
# user's password and policy document is checked before anything is created.
set -eu

: "${S3_URL:?}" "${S3_ROOT_USER:?}" "${S3_ROOT_PASSWORD:?}"
: "${DILOCO_BUCKET:?}" "${DILOCO_PREFIX:?}" "${DILOCO_WORKERS:?}" "${MLFLOW_BUCKET:?}"
: "${POLICIES_DIR:?}" "${DILOCO_ABORT_MULTIPART_HOURS:?}" "${CREDENTIALS_DIR:?}"
EXPIRE_DAYS="${DILOCO_EXPIRE_DAYS:-}"

case "${S3_SERVICE:-minio}" in
    minio) ;;
    seaweedfs)
        AWS_ACCESS_KEY_ID="$S3_ROOT_USER" AWS_SECRET_ACCESS_KEY="$S3_ROOT_PASSWORD" \
            exec python3 -m infra.iam_users --endpoint "$S3_URL" --policies "$POLICIES_DIR" \
            --workers "$DILOCO_WORKERS" --bucket "$DILOCO_BUCKET" \
            --mlflow-bucket "$MLFLOW_BUCKET" --out "$CREDENTIALS_DIR" ;;
    *)
        echo "setup: S3_SERVICE is minio or seaweedfs, not '$S3_SERVICE'" >&2
        exit 2 ;;
esac

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
    case "$secret" in *"'"*)
        echo "setup: $(password_var "$user") must not hold a quote (')" >&2; exit 2 ;;
    esac
    if [ "${#secret}" -lt 8 ]; then
        echo "setup: $(password_var "$user"), the password of MinIO user $user, must be" \
             "set in .env with 8 characters or more (e.g. openssl rand -hex 16)" >&2
        exit 2
    fi
done

mc alias set local "$S3_URL" "$S3_ROOT_USER" "$S3_ROOT_PASSWORD" >/dev/null

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
    mkdir -p "$CREDENTIALS_DIR/$user"
    umask 022
    printf "AWS_ACCESS_KEY_ID='%s'\nAWS_SECRET_ACCESS_KEY='%s'\nAWS_ENDPOINT_URL_S3='%s'\nMLFLOW_S3_ENDPOINT_URL='%s'\nAWS_DEFAULT_REGION='us-east-1'\n" \
        "$user" "$(password_of "$user")" "$S3_URL" "$S3_URL" > "$CREDENTIALS_DIR/$user/env"
    echo "user $user: policy $policy, keys in $CREDENTIALS_DIR/$user/env"
done

echo "MinIO ready: s3://$DILOCO_BUCKET/$DILOCO_PREFIX, one user per role"
