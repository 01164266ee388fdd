#!/usr/bin/env bash
# Corpus and model locations for the LS-C recipe, in one place.
# Edit the defaults below or export the variables before running run.sh.

# Folder that contains LibriSpeech/test-other (unpacked test-other.tar.gz from openslr.org/12).
LIBRISPEECH=${LIBRISPEECH:-}
# Clone of https://github.com/microsoft/MS-SNSD (its noise_test/ folder holds the noise files).
MS_SNSD=${MS_SNSD:-}
# Source model: a local directory with a transformers CTC model + processor, or a hub name
# (a hub name needs the files in the local Hugging Face cache when offline).
W2V2=${W2V2:-facebook/wav2vec2-base-960h}

db_file=$(CDPATH= cd -P -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)/db.sh
. "$(dirname "${db_file}")/../../tools/db_require.sh"
