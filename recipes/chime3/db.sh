#!/usr/bin/env bash
# Corpus and model locations for the CHiME-3 recipe, in one place.
# Edit the defaults below or export the variables before running run.sh.

# CHiME-3 root: the folder that contains data/audio/16kHz/enhanced/et05_* and data/transcriptions.
CHIME3=${CHIME3:-}
# Source model: a local directory with a transformers CTC model + processor, or a hub name
# (a hub name needs the files in the local Hugging Face cache when offline).
W2V2=${W2V2:-facebook/wav2vec2-base-960h}

db_file=$(CDPATH= cd -P -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)/db.sh
. "$(dirname "${db_file}")/../../tools/db_require.sh"
