"""What one request may ask of the server (docs/serving.md lists them with what
exceeding each returns). Plain numbers, so the CLI can show them without loading the
server."""

from __future__ import annotations

__all__ = ["DEFAULT_BACKLOG", "DEFAULT_BODY_READ_TIMEOUT", "DEFAULT_CLIENT_CPU_SHARE",
           "DEFAULT_H11_MAX_HEADER_COUNT", "DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE",
           "DEFAULT_KEEP_ALIVE_TIMEOUT", "DEFAULT_LIMIT_CONCURRENCY",
           "DEFAULT_MAX_LOGPROB_ENTRIES", "DEFAULT_MAX_REQUEST_BODY_BYTES",
           "LONG_TEXT_CHARS", "MAX_N", "MAX_OFFLOAD_WAITING", "MAX_STRING_LIST_CHARS",
           "MAX_STRING_LIST_ITEMS", "MOST_CALLS_PER_CLIENT", "OFFLOAD_PROCESSES",
           "OFFLOAD_THREADS"]

#: OpenAI's own limit on ``n`` (choices per prompt).
MAX_N = 128
#: Larger request bodies get 413 (``--max-request-body-bytes``).
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024
#: The most (token, logprob) entries one reply may carry, about 30 MiB of JSON
#: (``--max-logprob-entries``): n x tokens x (logprobs + 1), echoed prompts included.
DEFAULT_MAX_LOGPROB_ENTRIES = 2**20
#: Worker threads that tokenize, render chat templates and detokenize (server/offload.py).
OFFLOAD_THREADS = 4
#: Worker processes that encode long texts, and what a long text is (characters).
OFFLOAD_PROCESSES = 2
#: A client address's calls in worker processes at once (more wait their turn): paced
#: calls give up their places in the pool, so this is what keeps one client's many
#: connections from taking every place or starting a process each.
MOST_CALLS_PER_CLIENT = 2
LONG_TEXT_CHARS = 2**18
#: A long prompt that a model's context cannot hold is refused from its first
#: ``(max_model_len + PREFIX_MARGIN_TOKENS) * PREFIX_CHARS_PER_TOKEN`` characters alone
#: when they hold more tokens than that (server/offload.py's ``tokens_at_least``).
PREFIX_CHARS_PER_TOKEN = 8
PREFIX_MARGIN_TOKENS = 32
#: Calls that may wait for one of those threads (or processes); more get 503.
MAX_OFFLOAD_WAITING = 512
#: ``stop`` and ``bad_words``: at most this many strings, and this many characters in
#: all. Each is prepared once per request on the event loop (an automaton of the stop
#: strings, the bad words tokenized), so its size is bounded.
MAX_STRING_LIST_ITEMS = 128
MAX_STRING_LIST_CHARS = 4096

# What one connection may hold (server/admission.py, hypercorn's config).
#: HTTP requests served at once (``--limit-concurrency``); one more gets 503.
DEFAULT_LIMIT_CONCURRENCY = 2048
#: Seconds from a request's headers to the end of its body (``--body-read-timeout``);
#: a slower body gets 408. An 8 MiB body needs 280 KB/s.
DEFAULT_BODY_READ_TIMEOUT = 30.0
#: Seconds an idle connection stays open (``--timeout-keep-alive``; uvicorn's and
#: vLLM's 5, ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``); also the time to send the headers.
DEFAULT_KEEP_ALIVE_TIMEOUT = 5.0
#: The share of one core the answers one client address gets from the server alone
#: (``--client-cpu-share``, server/client_budget.py): 10 refused requests a second, or an
#: 8 MB body every 3 s. On 2 cores the model loses about three times the share taken
#: (its threads compute on one core while the server holds the other): 0.05 cost the
#: honest clients 14% of their throughput under a loop of refused requests.
DEFAULT_CLIENT_CPU_SHARE = 0.02
#: Connections the kernel queues unaccepted (uvicorn's 2048).
DEFAULT_BACKLOG = 2048
#: vLLM's defaults for ``--h11-max-incomplete-event-size`` (bytes of a request line and
#: headers) and ``--h11-max-header-count``.
DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE = 4 * 1024 * 1024
DEFAULT_H11_MAX_HEADER_COUNT = 256
