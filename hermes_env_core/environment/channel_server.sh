# hermes-env resident shell server: runs each command as a fresh child bash.
# Sent over the channel itself (never on a command line); Python fills in
# @NONCE@ and @MINVER@. Builtins only, except `cat` as the per-command relay.
#
# Requests (one header line, then payload bytes):
#   R id login scriptlen stdinlen   script bytes, then stdin as printf %b text (stdinlen -1: none)
#   A id                            the client has the command's report: end its relay
#   K id SIG                        signal the command's whole tree
#   Q                               quit
# Replies are lines starting with MARK = 0x1e nonce ':'  (H hello, N no, S started, X exit, D done;
# U: the runner's `times`, whose second line, the children's CPU, follows).
__hc_mark=$'\036'@NONCE@:
if ! ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] >= @MINVER@)); then
  builtin printf '%sNbash %s is older than the server needs\n' "$__hc_mark" "$BASH_VERSION"
  builtin exit 0
fi
__hc_cat=$(builtin type -P cat)
if [[ -z $__hc_cat ]]; then
  builtin printf '%sNno cat in PATH for the output relay\n' "$__hc_mark"
  builtin exit 0
fi
# Jobs get their own process group and keep SIGINT and SIGQUIT (a non-job-control
# shell makes asynchronous children ignore them, and exec'd bash cannot undo that).
builtin set -m 2>/dev/null || { builtin printf '%sNset -m failed\n' "$__hc_mark"; builtin exit 0; }
# The child is one level below the server, as if the target had started it.
[[ -n $SHLVL ]] && builtin export SHLVL=$((SHLVL - 1))
__hc_cur= __hc_runner= __hc_relay= __hc_o= __hc_killed=
declare -A __hc_signalled=()
__hc_lc_set=${LC_ALL+1} __hc_lc=$LC_ALL
LC_ALL=C

__hc_new_relay() {
  # A fresh pipe per command, drained by its own cat: when the relay is
  # killed, a background writer left behind gets EPIPE instead of writing
  # into a later command's output.
  exec {__hc_o}> >(exec "$__hc_cat")
  __hc_relay=$!
}

__hc_run() {  # scriptlen stdinlen: read the payload (lengths count bytes: LC_ALL=C)
  IFS= builtin read -r -N "$1" __hc_s || return 1
  __hc_in= __hc_hasin=0
  if [[ $2 != -1 ]]; then
    __hc_hasin=1
    IFS= builtin read -r -N "$2" __hc_in || return 1
  fi
}

__hc_child() {  # login stdin-present; runs in the runner subshell
  local -a argv=(bash)
  [[ $1 == 1 ]] && argv+=(-l)
  if ((${#__hc_s} > 100000)); then
    argv+=(-c 'builtin source /dev/fd/3' bash)
    if [[ $2 == 1 ]]; then
      "${argv[@]}" 3< <(builtin printf '%s' "$__hc_s") < <(builtin printf '%b' "$__hc_in") >&"$__hc_o" 2>&1 {__hc_o}>&-
    else
      "${argv[@]}" 3< <(builtin printf '%s' "$__hc_s") </dev/null >&"$__hc_o" 2>&1 {__hc_o}>&-
    fi
  elif [[ $2 == 1 ]]; then
    "${argv[@]}" -c "$__hc_s" bash < <(builtin printf '%b' "$__hc_in") >&"$__hc_o" 2>&1 {__hc_o}>&-
  else
    "${argv[@]}" -c "$__hc_s" bash </dev/null >&"$__hc_o" 2>&1 {__hc_o}>&-
  fi
}

__hc_runner_main() {  # id login stdin-present
  # Only the server holds the stream: when it dies, the client sees it.
  exec 0</dev/null 1>/dev/null
  # The child gets the locale the server was started with.
  if [[ -n $__hc_lc_set ]]; then LC_ALL=$__hc_lc; else builtin unset -v LC_ALL; fi
  __hc_child "$2" "$3"
  local rc=$?
  # CPU time of the command's tree (the children line of `times`), then the exit.
  { builtin printf '%sU' "$__hc_mark"; builtin times; builtin printf '%sX%s %d\n' "$__hc_mark" "$1" "$rc"; } >&"$__hc_o"
}

__hc_kill() {  # SIG: stop, signal and resume every process of the command's tree
  local sig=$1 root=$__hc_runner rounds=1 p s
  [[ -n $root ]] || return 0
  [[ $sig == KILL ]] && rounds=50
  local -A kids seen
  local -a todo all
  while ((rounds--)); do
    kids=() seen=() todo=() all=()
    for p in /proc/[0-9]*; do
      IFS= builtin read -r s 2>/dev/null <"$p/stat" || continue
      s=${s##*) }
      builtin set -- $s
      [[ $1 == Z ]] && continue
      kids[$2]+=" ${p#/proc/}"
      [[ $3 == "$root" && ${p#/proc/} != "$root" ]] && todo+=("${p#/proc/}")
    done
    todo+=(${kids[$root]})
    while ((${#todo[@]})); do
      p=${todo[0]}
      todo=("${todo[@]:1}")
      [[ -n ${seen[$p]} || $p == "$root" || $p == "$__hc_relay" ]] && continue
      seen[$p]=1
      all+=("$p")
      todo+=(${kids[$p]})
    done
    # Remembered: one that setsid()s and loses its parent is still swept at the end.
    for p in "${all[@]}"; do __hc_signalled[$p]=1; done
    ((${#all[@]})) || return 0
    builtin kill -STOP "${all[@]}" 2>/dev/null
    builtin kill "-$sig" "${all[@]}" 2>/dev/null
    builtin kill -CONT "${all[@]}" 2>/dev/null
  done
  return 0
}

__hc_end() {  # id: the report reached the client; stop the relay, then say so
  local s n=0
  if [[ -n $__hc_relay ]]; then
    builtin kill -KILL "$__hc_relay" 2>/dev/null
    builtin wait "$__hc_relay" 2>/dev/null
    if (($? == 127)); then
      # bash < 5.1 cannot wait for a process substitution: watch it die.
      while ((n++ < 100000)) && IFS= builtin read -r s 2>/dev/null <"/proc/$__hc_relay/stat"; do
        s=${s##*) }
        [[ ${s%% *} == [ZX] ]] && break
      done
    fi
  fi
  [[ -n $__hc_runner ]] && builtin wait "$__hc_runner" 2>/dev/null
  # A killed command's bash is gone; whatever is left of its tree goes too.
  if [[ -n $__hc_killed ]]; then
    __hc_kill KILL
    ((${#__hc_signalled[@]})) && builtin kill -KILL "${!__hc_signalled[@]}" 2>/dev/null
  fi
  __hc_signalled=()
  __hc_relay= __hc_cur= __hc_runner= __hc_killed=
  builtin printf '%sD%s\n' "$__hc_mark" "$1"
  __hc_new_relay
}

__hc_quit() {
  # The client is gone (or said Q): a running command goes with the server,
  # as a command's bash does when its connection drops.
  builtin trap - HUP PIPE TERM
  [[ -n $__hc_cur ]] && __hc_kill KILL
  [[ -n $__hc_relay ]] && builtin kill -KILL "$__hc_relay" 2>/dev/null
  builtin exit 0
}

# Caught (not ignored): children still start with the default dispositions.
builtin trap __hc_quit HUP PIPE TERM
__hc_new_relay
builtin printf '%sH%d %s\n' "$__hc_mark" "$$" "$BASH_VERSION"
while IFS=' ' builtin read -r __hc_op __hc_a __hc_b __hc_c __hc_d; do
  case $__hc_op in
    R)
      __hc_run "$__hc_c" "$__hc_d" || break
      __hc_cur=$__hc_a
      builtin printf '%sS%s\n' "$__hc_mark" "$__hc_a"
      __hc_runner_main "$__hc_a" "$__hc_b" "$__hc_hasin" &
      __hc_runner=$!
      exec {__hc_o}>&-
      __hc_s= __hc_in=
      ;;
    A) [[ $__hc_a == "$__hc_cur" ]] && __hc_end "$__hc_a" ;;
    K) [[ $__hc_a == "$__hc_cur" ]] && { __hc_killed=1; __hc_kill "$__hc_b"; } ;;
    Q) break ;;
    *) break ;;
  esac
done
__hc_quit
