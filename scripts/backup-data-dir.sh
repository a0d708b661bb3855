#!/usr/bin/env bash
# A backup of relay's DATA_DIR taken while relay runs (docs/operating.md, "Backups"): a
# snapshot of the journal's segments as hard links, safe while compaction deletes segments.
#
#   scripts/backup-data-dir.sh DATA_DIR SNAPSHOT_DIR
#
# SNAPSHOT_DIR must not exist yet and must be on the filesystem of DATA_DIR (hard links). Copy
# it anywhere afterwards (tar, rsync, a volume snapshot), then remove it: until then it keeps
# the disk space of segments relay has deleted since. To restore: stop relay, empty DATA_DIR,
# copy the snapshot's *.journal files into it, start relay (it cuts a torn last record off, as
# after a crash).
#
# Why this is safe: relay deletes segments strictly oldest first, each only once records in
# newer segments replaced everything in it that was still needed. A hard link keeps a segment
# whole whatever relay deletes afterwards, and segments are linked oldest first. The directory
# is listed again until its newest segment is linked: a segment made while the script ran can
# hold the records that replaced one relay deleted meanwhile (a long-waiting task carried
# forward). Then only the unbroken run of numbers that ends at the newest is kept: a segment
# older than a gap was deleted by relay, with every segment before it, after the snapshot had
# linked it; its records were all replaced in segments the snapshot holds, while keeping it
# without the missing ones could bring a forgotten task back. Copying the files instead of
# linking them is not safe: records appended to the newest segment after it was copied would
# be missing from the middle of the journal.
set -euo pipefail

usage="usage: $0 DATA_DIR SNAPSHOT_DIR"
data=${1:?$usage}
snap=${2:?$usage}
[ -d "$data" ] || { echo "$data is not a directory" >&2; exit 2; }
mkdir -m 700 "$snap"
snap=$(cd "$snap" && pwd)

# Segment names have a fixed width: name order is number order.
segments() { ls -1 "$data" | grep -E '^[0-9]{10}\.journal$' | sort || true; }

# Each pass links every segment not linked yet with one `ln` (a process per segment could not
# keep up with a journal of small segments under load: new ones came faster than a pass).
passes=0
while :; do
  passes=$((passes + 1))
  new=$(comm -23 <(segments) <(ls -1 "$snap" | sort))
  if [ -n "$new" ]; then
    # (Names are ten digits and `.journal`: no quoting needed.) A segment compaction deleted
    # since the listing fails to link, and the gap check below handles it.
    # shellcheck disable=SC2086
    (cd "$data" && ln -- $new "$snap"/ 2>/dev/null) || true
    for name in $new; do
      if [ ! -e "$snap/$name" ] && [ -e "$data/$name" ]; then
        echo "cannot link $data/$name into $snap (is it on the same filesystem?)" >&2
        exit 1
      fi
    done
  fi
  newest=$(segments | tail -n 1)
  if [ -z "$newest" ] || [ -e "$snap/$newest" ]; then
    break
  fi
done

# Keep the unbroken run of segment numbers that ends at the newest.
prev=""
gap=false
dropped=0
for name in $(ls -1 "$snap" | sort -r); do
  num=$((10#${name%.journal}))
  if [ "$gap" = false ] && [ -n "$prev" ] && [ "$num" -ne $((prev - 1)) ]; then
    gap=true
  fi
  if [ "$gap" = true ]; then
    rm -f "$snap/$name"
    dropped=$((dropped + 1))
  else
    prev=$num
  fi
done

kept=$(ls -1 "$snap" | wc -l)
echo "snapshot $snap: $kept segments ($passes passes, $dropped older than a gap left out)"
