# bash completion for tetra's `train` (and `topo`, `ckpt`: their options).
#
#   source tools/completion/train.bash        # or: installed by `cmake --install` under
#                                             # share/bash-completion/completions/
#
# train: options; job files (*.yaml, *.yml) and folders; after --set, every key a job file
# takes and, after `key=`, the words of a choice (`--set model.type=<TAB>` offers mlp, cnn,
# gpt), from `train --list-keys` of the train being completed, so the keys are always the
# parsers' own.

# The word being completed, whole: bash splits `model.type=g` at '=' (COMP_WORDBREAKS).
_tetra_current_word() {
  local line=${COMP_LINE:0:COMP_POINT}
  printf '%s' "${line##*[[:space:]]}"
}

# COMPREPLY from `words` matching `whole`, relative to what bash thinks the word is (the
# part after the last '=' or ':' when those break words).
_tetra_reply() {
  local whole=$1 words=$2 w
  COMPREPLY=()
  local IFS=$'\n'
  for w in $(compgen -W "$words" -- "$whole"); do
    if [[ $COMP_WORDBREAKS == *=* && $whole == *=* ]]; then w=${w#"${whole%=*}="}; fi
    COMPREPLY+=("$w")
  done
}

_tetra_train() {
  local cur prev whole
  cur=${COMP_WORDS[COMP_CWORD]}
  whole=$(_tetra_current_word)
  # the word before the current one, whole words only (skip the pieces '=' made)
  local before=${COMP_LINE:0:COMP_POINT}
  before=${before%"$whole"}
  before=${before%"${before##*[![:space:]]}"}
  prev=${before##*[[:space:]]}
  case $prev in
    --set)
      local keys
      keys=$("${COMP_WORDS[0]}" --list-keys 2>/dev/null) || return 0
      # the keys first; a choice's words once its key and '=' are typed
      [[ $whole == *=* ]] || keys=$(grep -v = <<<"$keys")
      _tetra_reply "$whole" "$keys"
      # a key goes on with '=': no space after a key that has no '=' yet
      if ((${#COMPREPLY[@]} == 1)) && [[ $whole != *=* ]]; then
        COMPREPLY[0]+="="
        compopt -o nospace 2>/dev/null
      fi
      return 0 ;;
    --calibration | -o | --output) COMPREPLY=($(compgen -f -- "$cur")); return 0 ;;
    --np | --ranks-per-host | --memory-gb | --budget | --trials | --trial-steps | --launcher) return 0 ;;
  esac
  if [[ $cur == -* ]]; then
    COMPREPLY=($(compgen -W "--set --check --print-config --dry-run --np --ranks-per-host --calibration --json
                             --time-layers --tune --memory-gb --budget --output --trials --trial-steps --launcher
                             --schema --list-keys --version --help" -- "$cur"))
    return 0
  fi
  compopt -o filenames 2>/dev/null
  COMPREPLY=($(compgen -f -X '!*.@(yaml|yml)' -- "$cur") $(compgen -d -- "$cur"))
}

_tetra_options() {  # topo, ckpt: their --help's long options
  local cur=${COMP_WORDS[COMP_CWORD]}
  if [[ $cur == -* ]]; then
    COMPREPLY=($(compgen -W "$("${COMP_WORDS[0]}" --help 2>/dev/null | grep -o -- '--[a-z][a-z-]*' | sort -u)" -- "$cur"))
  else
    compopt -o filenames 2>/dev/null
    COMPREPLY=($(compgen -f -- "$cur"))
  fi
}

shopt -s extglob
complete -F _tetra_train train
complete -F _tetra_options topo ckpt
