#!/usr/bin/env bash
# Find a corpus and put it under data/<name>/ (or --dest DIR):
#   1. already in data/<name>/            → nothing to do
#   2. in ../shared/data/<name>/ (beside the checkout, or $TFM_SHARED_DATA/<name>) → copied
#   3. else downloaded from its public source (fails with a clear message when offline)
# --lines N writes only the first N lines of every file (test slices).
#
# usage: scripts/get_data.sh multi30k [--dest DIR] [--lines N]
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)

name=${1:-}
[ -n "$name" ] || { echo "usage: $0 multi30k|wmt14|iwslt14 [--dest DIR] [--lines N]" >&2; exit 2; }
shift
dest="$root/data/$name"
lines=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dest) dest=$2; shift 2 ;;
    --lines) lines=$2; shift 2 ;;
    *) echo "get_data.sh: unknown option $1" >&2; exit 2 ;;
  esac
done

case "$name" in
  multi30k)
    files="train.de.gz train.en.gz train.fr.gz train.cs.gz val.de.gz val.en.gz val.fr.gz val.cs.gz
           test_2016_flickr.de.gz test_2016_flickr.en.gz test_2016_flickr.fr.gz test_2016_flickr.cs.gz"
    url="https://github.com/multi30k/dataset/raw/master/data/task1/raw" ;;
  wmt14)
    files="newstest2013.de.gz newstest2013.en.gz newstest2014.de.gz newstest2014.en.gz"
    url="" ;;  # plain-text files in Helsinki-NLP/OPUS-MT-testsets (not gzipped): fetched below
  iwslt14)
    files="valid.de.gz valid.en.gz test.de.gz test.en.gz test.raw.de.gz test.raw.en.gz"
    url="" ;;
  *) echo "get_data.sh: unknown corpus '$name' (multi30k, wmt14, iwslt14)" >&2; exit 2 ;;
esac

shared="${TFM_SHARED_DATA:-$root/../shared/data}/$name"
local_dir="$root/data/$name"
mkdir -p "$dest"

fetch() {  # fetch FILE → $dest/FILE (full, or first $lines lines, still gzipped)
  local f=$1 src=""
  if [ -f "$local_dir/$f" ]; then src="$local_dir/$f"
  elif [ -f "$shared/$f" ]; then src="$shared/$f"
  fi
  if [ -z "$src" ]; then
    local tmp; tmp=$(mktemp)
    case "$name" in
      multi30k) remote="$url/$f" ;;
      wmt14) remote="https://raw.githubusercontent.com/Helsinki-NLP/OPUS-MT-testsets/master/testsets/de-en/${f%.gz}" ;;
      iwslt14) echo "get_data.sh: $f is not available locally; IWSLT14 must be prepared with fairseq's examples/translation/prepare-iwslt14.sh" >&2; exit 1 ;;
    esac
    if ! curl -fsSL --retry 2 -o "$tmp" "$remote"; then
      rm -f "$tmp"
      echo "get_data.sh: could not download $remote (offline?); put the files in $local_dir or $shared" >&2
      exit 1
    fi
    case "$remote" in *.gz) src=$tmp ;; *) gzip -c "$tmp" > "$tmp.gz"; rm -f "$tmp"; src=$tmp.gz ;; esac
  fi
  [ "$src" -ef "$dest/$f" ] && return 0
  if [ -n "$lines" ]; then
    # `|| true`: head closing the pipe early is expected.
    { gzip -dc "$src" | head -n "$lines" || true; } | gzip -c > "$dest/$f.tmp"
  else
    cp "$src" "$dest/$f.tmp"; chmod u+w "$dest/$f.tmp"
  fi
  # the same bytes there already: left as they are (a new file time would make prepared runs prepare again)
  if cmp -s "$dest/$f.tmp" "$dest/$f"; then rm -f "$dest/$f.tmp"; else mv "$dest/$f.tmp" "$dest/$f"; fi
}

for f in $files; do fetch "$f"; done
echo "$name → $dest${lines:+ (first $lines lines)}"
