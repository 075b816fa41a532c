"""Triton Python-backend model: one SharpDraft engine per instance, and both variants
batch in flight: requests join a running batch at step boundaries
(runtime/serve/scheduler.py, up to the max_batch parameter, max_queue waiting, more
refused as UNAVAILABLE). The streaming (decoupled) model sends each request's tokens as
they commit; the plain model sends one response when its request is done, through the
same response sender, so execute() returns at once and the next request can join the
batch. Copied verbatim into each generated repository as <model>/1/model.py by
runtime/serve/repository.py; everything it needs to know comes from config.pbtxt."""

import json
import os
import sys

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        # The repository points back at the checkout that wrote it (paths relative to this
        # model's directory), so a server started by hand (not through `serve --start`)
        # still finds the runtime package, and a moved checkout still serves.
        model_dir = args["model_repository"]
        repo_root = os.path.normpath(os.path.join(model_dir, params["repo_root"]))
        engine_dir = os.path.normpath(os.path.join(model_dir, params["engine_dir"]))
        if repo_root not in sys.path:
            sys.path.insert(0, repo_root)
        os.environ["HF_HUB_OFFLINE"] = "1"  # offline by construction: never touch a hub
        import torch

        # Instances are separate processes on the same cores: share the cores out rather
        # than let every instance start one thread per core and contend.
        instances = sum(int(g.get("count", 1)) for g in config.get("instance_group", [])) or 1
        threads = params.get("threads", "auto")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // instances)
                              if threads == "auto" else int(threads))

        from runtime.serve import protocol
        from runtime.request import Request
        from runtime.serve.scheduler import CANCEL_STAGES, TURNS, Cancelled, QueueFull, StepScheduler
        from runtime.streaming import TextStream

        self.protocol, self.TextStream = protocol, TextStream
        self.limit = int(params["max_new_tokens_limit"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        from runtime.backends import OPTIONS

        from runtime.spec import open_spec

        options = {k: params[k] for k in OPTIONS if params.get(k)}  # the loader's, as serve wrote them
        # the engine's spec opened once in this process, here, where it enters
        self.engine = protocol.load_engine(open_spec(engine_dir, params.get("backend") or None,
                                                     **options))
        self.Cancelled, self.Request, self.QueueFull = Cancelled, Request, QueueFull
        # prompts longer than this many bytes cannot fit the context: refused untokenized
        self.prompt_bytes = protocol.prompt_byte_limit(self.engine.tokenizer, self.engine.context_limit)
        max_batch = int(params.get("max_batch", "1"))
        self.batch_peak = _BatchPeak(args["model_name"], args["model_instance_name"])
        self.turns = _Turns(args["model_name"], args["model_instance_name"], TURNS)
        self.cancellations = _Cancellations(args["model_name"], args["model_instance_name"],
                                            CANCEL_STAGES)
        self.scheduler = StepScheduler(self.engine, max_batch, int(params.get("max_queue", "64")),
                                       int(params.get("prefill_chunk", "0")), self.turns.observe)
        from runtime import metrics, modes

        self.speculation = _Speculation(args["model_name"], args["model_instance_name"],
                                        metrics, modes)
        from runtime.serve import vllm_metrics

        self.vllm = _VllmMetrics(args["model_name"], args["model_instance_name"], vllm_metrics)
        pb_utils.Logger.log_info(f"{args['model_instance_name']}: engine {engine_dir} "
                                 f"loaded, {torch.get_num_threads()} torch thread(s), "
                                 f"{'streaming' if self.decoupled else 'one response per request'}, "
                                 f"in-flight batches of up to {max_batch}, prompts prefilled "
                                 f"{self.scheduler.prefill_chunk or 'whole'} tokens at a time")

    def execute(self, requests):
        # Both variants answer through each request's response sender, from the
        # scheduler's thread; returning None at once lets Triton hand this instance the
        # next request while the batch runs (a plain model too: one final response each).
        for request in requests:
            self._submit(request)
        return None

    def _arrays(self, request):
        arrays = {}
        for spec in self.protocol.INPUTS:
            tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
            arrays[spec.name] = None if tensor is None else tensor.as_numpy()
        return arrays

    def _prepare(self, request):
        # The generate endpoint turns JSON fields that name no input into request
        # parameters; parse() refuses them so a misspelt field is an error, not ignored.
        parameters = json.loads(request.parameters() or "{}")
        req = self.protocol.parse(self._arrays(request), self.limit, parameters)
        ids = self.protocol.encode_prompt(self.engine, req, self.prompt_bytes)
        req.mode(self.engine)  # a mode this engine cannot run: refused before any work
        return req, ids

    def _error(self, exc):
        if isinstance(exc, self.protocol.RequestError):
            return pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
        if isinstance(exc, self.QueueFull):  # HTTP 503 / gRPC UNAVAILABLE: retry later
            return pb_utils.TritonError(str(exc), pb_utils.TritonError.UNAVAILABLE)
        if isinstance(exc, self.Cancelled):
            return pb_utils.TritonError("the request was cancelled", pb_utils.TritonError.CANCELLED)
        # A bug, not the request: the details (paths, internals) stay in the server log.
        reply, log = self.protocol.internal_error(exc)
        pb_utils.Logger.log_error(log)
        return pb_utils.TritonError(reply, pb_utils.TritonError.INTERNAL)

    def _tensors(self, arrays):
        return [pb_utils.Tensor(name, value) for name, value in arrays.items()]

    def _submit(self, request):
        """Parse the request and queue it for the scheduler's running batch; a bad request
        or a full queue is answered at once, with an error as its final response."""
        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            params, ids = self._prepare(request)
            # a request naming no mode runs the default for the load it joins (the
            # scheduler resolves it at admission)
            named = params.asked_mode is not None or params.sharpdraft is not None
            prompt_entries = []  # echo: the prompt's log-probabilities, once scored
            on_tokens, on_done, on_error = self._callbacks(request, sender, len(ids),
                                                           params.logprobs, prompt_entries)
            self.scheduler.submit(self.Request(
                prompt=ids, max_new_tokens=params.max_new_tokens, sampling=params.sampling,
                stop_ids=frozenset() if params.ignore_eos else self.engine.stop_ids,
                logprobs=params.logprobs, mode=params.mode(self.engine) if named else None,
                on_tokens=on_tokens, on_done=on_done, on_error=on_error,
                on_prompt=(self._prompt_callback(sender, len(ids), prompt_entries)
                           if params.prompt_logprobs else None),
                cancelled=request.is_cancelled))
            self.vllm.loads(self.scheduler)
        except Exception as exc:
            sender.send(pb_utils.InferenceResponse(error=self._error(exc)), flags=final)

    def _prompt_callback(self, sender, prompt_tokens: int, kept: list):
        """The prompt's log-probabilities: a response of their own ahead of any token
        (streaming), or kept for the one final response (plain)."""
        def on_prompt(entries):
            kept.extend(entries)
            if self.decoupled:
                arrays = {"prompt_logprob_entries": self.protocol.logprobs_array(entries),
                          "prompt_tokens": self.protocol.count_array(prompt_tokens)}
                sender.send(pb_utils.InferenceResponse(output_tensors=self._tensors(arrays)))

        return on_prompt

    def _callbacks(self, request, sender, prompt_length: int, logprobs: int | None,
                   prompt_entries: list):
        """on_tokens, on_done, on_error for one request, called on the scheduler's thread.
        Streaming: a response per commit (its token_ids and text), then a final one with
        the statistics and any text held back mid-character. Plain: one final response
        with the whole text and token ids. on_tokens raises Cancelled once the client has
        gone, so the batch stops spending steps on it."""
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        text = self.TextStream(self.engine.decode)
        clock = self.vllm.clock()
        prompt_tokens = self.protocol.count_array(prompt_length)

        def on_tokens(new, entries=None):
            self.batch_peak.observe(self.scheduler.running)
            self.vllm.tokens(clock, self.scheduler)
            if request.is_cancelled():
                raise self.Cancelled("decode")
            if self.decoupled:
                # each response says the prompt's size, so a client can report running usage
                arrays = {"text": self.protocol.text_array(text.push(new)),
                          "token_ids": self.protocol.ids_array(new), "prompt_tokens": prompt_tokens}
                if entries is not None:
                    arrays["logprob_entries"] = self.protocol.logprobs_array(entries)
                sender.send(pb_utils.InferenceResponse(output_tensors=self._tensors(arrays)))

        def on_done(gen, mode):
            reason = self.protocol.finish_reason(gen)
            arrays = (self.protocol.outputs(text.flush(), [], gen, reason, mode) if self.decoupled else
                      self.protocol.outputs(self.engine.decode(gen.tokens), gen.tokens, gen, reason,
                                            mode, gen.logprobs if logprobs is not None else None))
            if not self.decoupled and prompt_entries:
                arrays["prompt_logprob_entries"] = self.protocol.logprobs_array(prompt_entries)
            # counted before the reply goes out, so a client that scrapes the metrics
            # after its response sees its own steps there
            self.speculation.observe(mode, gen)
            self.vllm.done(clock, gen, reason, self.scheduler)
            sender.send(pb_utils.InferenceResponse(output_tensors=self._tensors(arrays)), flags=final)

        def on_error(exc):
            self.vllm.loads(self.scheduler)
            if isinstance(exc, self.Cancelled):
                self.cancellations.observe(exc.stage)
            if isinstance(exc, self.Cancelled) and self.decoupled:
                sender.send(flags=final)  # the stream just ends: its client has gone
                return
            if isinstance(exc, ValueError) and not isinstance(exc, self.protocol.RequestError):
                exc = self.protocol.RequestError(str(exc))  # the request's own input
            sender.send(pb_utils.InferenceResponse(error=self._error(exc)), flags=final)

        return on_tokens, on_done, on_error

    def finalize(self):
        self.scheduler.close()
        self.engine = None


class _BatchPeak:
    """The most sequences one instance's batch has held at a step, as the Prometheus gauge
    sharpdraft_batch_peak_rows on Triton's metrics endpoint: whether requests really share
    steps (the serving tests read it)."""

    def __init__(self, model: str, instance: str):
        # The family must outlive its metric (the backend refuses to set a metric whose
        # family was garbage-collected), so both are kept.
        self.family = pb_utils.MetricFamily(name="sharpdraft_batch_peak_rows",
                                            kind=pb_utils.MetricFamily.GAUGE,
                                            description="most sequences decoded in one step of "
                                                        "this instance's in-flight batch")
        self.gauge = self.family.Metric(labels={"model": model, "instance": instance})
        self.peak = 0

    def observe(self, rows: int) -> None:
        if rows > self.peak:
            self.peak = rows
            self.gauge.set(rows)


class _Cancellations:
    """Requests whose clients went away, per stage they left at (scheduler.CANCEL_STAGES:
    queue, prefill, decode): the counter sharpdraft_cancelled_requests_total{stage}."""

    def __init__(self, model: str, instance: str, stages):
        # the family must outlive its metrics (see _BatchPeak)
        self.family = pb_utils.MetricFamily(name="sharpdraft_cancelled_requests_total",
                                            kind=pb_utils.MetricFamily.COUNTER,
                                            description="requests dropped because their client "
                                                        "had gone, by the stage they left at")
        self.counters = {stage: self.family.Metric(labels={"model": model, "instance": instance,
                                                           "stage": stage}) for stage in stages}

    def observe(self, stage: str) -> None:
        self.counters[stage].increment(1)


class _Turns:
    """How long the scheduler's turns make running streams wait (scheduler.TURNS: step,
    chunk, join, prefill), per model and instance: the histogram sharpdraft_turn_seconds
    {kind} and the gauge sharpdraft_turn_longest_seconds{kind}. A running stream waits one
    prefill turn and one step between two responses, so with chunked prefill the longest
    chunk + the longest step bound its worst gap under this server's own load
    (scripts/chunked_prefill_ab.py reads them)."""

    BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]

    def __init__(self, model: str, instance: str, kinds):
        labels = {"model": model, "instance": instance}
        # families must outlive their metrics (see _BatchPeak): both are kept
        self.families = [
            pb_utils.MetricFamily(name="sharpdraft_turn_seconds",
                                  kind=pb_utils.MetricFamily.HISTOGRAM,
                                  description="seconds of one scheduler turn that running "
                                              "streams wait on: a step, a prefill chunk, a "
                                              "join's last part, a prefill with no budget"),
            pb_utils.MetricFamily(name="sharpdraft_turn_longest_seconds",
                                  kind=pb_utils.MetricFamily.GAUGE,
                                  description="the longest scheduler turn of each kind so far")]
        self.seconds = {kind: self.families[0].Metric(labels=labels | {"kind": kind},
                                                      buckets=self.BUCKETS) for kind in kinds}
        self.longest_gauge = {kind: self.families[1].Metric(labels=labels | {"kind": kind})
                              for kind in kinds}
        self.longest = dict.fromkeys(kinds, 0.0)

    def observe(self, kind: str, seconds: float) -> None:
        self.seconds[kind].observe(seconds)
        if seconds > self.longest[kind]:
            self.longest[kind] = seconds
            self.longest_gauge[kind].set(seconds)


class _Speculation:
    """What speculation buys, on Triton's metrics endpoint, per model, instance, mode and
    context-length bucket (runtime/metrics.py: CONTEXT_BUCKETS), from each finished
    request's recorded steps (Generation.steps: the visible keys and beta the step itself
    recorded). Counters: sharpdraft_spec_{requests,steps,drafting_steps,draft_tokens,
    accepted_tokens,drafter_sitouts}_total and sharpdraft_spec_accepted_tokens_per_position_total
    {position}; a histogram of the drafter steps' beta; the mean accepted length as a
    gauge (committed tokens over verify steps, this instance's requests so far)."""

    COUNTERS = {
        "requests": "finished requests that ran a verify step (in the bucket of the first)",
        "steps": "target verify steps",
        "drafting_steps": "target verify steps that checked at least one draft",
        "draft_tokens": "draft tokens verified",
        "accepted_tokens": "draft tokens accepted (the target's own token not counted)",
        "drafter_sitouts": "steps of a drafter mode on which the drafter did not run",
    }
    BETA_BUCKETS = [1.0, 1.05, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 2.0]

    def __init__(self, model: str, instance: str, metrics, modes):
        self.metrics, self.modes = metrics, modes
        self.labels = {"model": model, "instance": instance}
        counter, gauge = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        # families must outlive their metrics (see _BatchPeak): both are kept
        self.families = {name: pb_utils.MetricFamily(name=f"sharpdraft_spec_{name}_total",
                                                     kind=counter, description=description)
                         for name, description in self.COUNTERS.items()}
        self.families["per_position"] = pb_utils.MetricFamily(
            name="sharpdraft_spec_accepted_tokens_per_position_total", kind=counter,
            description="steps that accepted the draft at this 1-based position")
        self.families["beta"] = pb_utils.MetricFamily(
            name="sharpdraft_spec_beta", kind=pb_utils.MetricFamily.HISTOGRAM,
            description="query scale beta at each drafter step (first query row), as the step recorded it")
        self.families["mal"] = pb_utils.MetricFamily(
            name="sharpdraft_spec_mean_accepted_length", kind=gauge,
            description="tokens committed per target verify step (accepted drafts + the target's own)")
        self.series: dict = {}
        self.mal: dict = {}  # (mode, bucket) -> [committed tokens, steps]

    def _metric(self, family: str, buckets=None, **labels):
        key = (family, tuple(sorted(labels.items())))
        if key not in self.series:
            extra = {} if buckets is None else {"buckets": buckets}
            self.series[key] = self.families[family].Metric(labels=self.labels | labels, **extra)
        return self.series[key]

    def observe(self, mode, gen) -> None:
        mode = self.modes.Mode(mode)
        totals = self.metrics.speculation_totals(gen, mode.uses_drafter_model)
        first = True
        for bucket, t in totals.items():
            labels = {"mode": str(mode), "context": bucket}
            if first:  # a request counts once, in the bucket its first step ran in
                self._metric("requests", **labels).increment(1)
                first = False
            for name in ("steps", "drafting_steps", "draft_tokens", "accepted_tokens", "drafter_sitouts"):
                self._metric(name, **labels).increment(getattr(t, name))
            for position, count in t.accepted_per_position.items():
                self._metric("per_position", **labels, position=str(position)).increment(count)
            for beta in t.betas:
                self._metric("beta", buckets=self.BETA_BUCKETS, **labels).observe(beta)
            mal = self.mal.setdefault((str(mode), bucket), [0, 0])
            mal[0] += t.accepted_tokens + t.steps
            mal[1] += t.steps
            self._metric("mal", **labels).set(mal[0] / mal[1])


class _VllmMetrics:
    """vLLM's families on Triton's metrics port (runtime/serve/vllm_metrics.py: the one
    table; the OpenAI endpoint exports the same on its own /metrics), per model and
    instance: speculation counted as vLLM counts it, running and waiting requests, TTFT,
    inter-token and end-to-end latency, prompt and generation tokens."""

    def __init__(self, model: str, instance: str, table):
        self.table = table
        labels = {table.LABEL: model, "instance": instance}
        counter, gauge = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        # families must outlive their metrics (see _BatchPeak): both are kept. Triton
        # names a counter as given, so the _total is ours (prometheus_client adds it)
        self.families = {name: pb_utils.MetricFamily(name=name + "_total", kind=counter, description=text)
                         for name, text in (table.SPEC | table.COUNTERS | dict([table.SUCCESS])).items()}
        self.families |= {name: pb_utils.MetricFamily(name=name, kind=gauge, description=text)
                          for name, text in table.GAUGES.items()}
        self.families |= {name: pb_utils.MetricFamily(name=name, kind=pb_utils.MetricFamily.HISTOGRAM,
                                                      description=text)
                          for name, (text, _) in table.HISTOGRAMS.items()}
        name, text = table.SPEC_PER_POSITION
        self.families[name] = pb_utils.MetricFamily(name=name + "_total", kind=counter, description=text)
        self.metrics = {name: (self.families[name].Metric(labels=labels, buckets=table.HISTOGRAMS[name][1])
                               if name in table.HISTOGRAMS else self.families[name].Metric(labels=labels))
                        for name in self.families if name not in (table.SPEC_PER_POSITION[0], table.SUCCESS[0])}
        self.success = {reason: self.families[table.SUCCESS[0]].Metric(labels=labels | {table.FINISHED: reason})
                        for reason in table.FINISHED_REASONS}
        self.labels, self.per_position = labels, {}

    def clock(self):
        return self.table.RequestClock()

    def loads(self, scheduler) -> None:
        # read from two threads: lengths read whole, a snapshot is all a gauge is
        self.metrics["vllm:num_requests_running"].set(scheduler.running)
        self.metrics["vllm:num_requests_waiting"].set(len(scheduler.waiting) + len(scheduler.joining))

    def tokens(self, clock, scheduler) -> None:
        first = clock.last is None
        clock.tokens()
        if first:
            self.metrics["vllm:time_to_first_token_seconds"].observe(clock.ttft)
            self.loads(scheduler)
        else:
            self.metrics["vllm:inter_token_latency_seconds"].observe(clock.gaps[-1])

    def done(self, clock, gen, reason: str, scheduler) -> None:
        """A request finished: `reason` its finish_reason (protocol.finish_reason)."""
        self.metrics["vllm:e2e_request_latency_seconds"].observe(clock.e2e())
        self.success[reason].increment(1)
        self.metrics["vllm:prompt_tokens"].increment(gen.prompt_tokens)
        self.metrics["vllm:generation_tokens"].increment(len(gen.tokens))
        steps = gen.steps()
        spec = self.table.Speculation.of([s.drafts for s in steps], [s.accepted for s in steps])
        for name, value in spec.counts().items():
            self.metrics[name].increment(value)
        name = self.table.SPEC_PER_POSITION[0]
        for position, count in spec.per_position.items():
            if position not in self.per_position:
                self.per_position[position] = self.families[name].Metric(
                    labels=self.labels | {"position": str(position)})
            self.per_position[position].increment(count)
        self.loads(scheduler)
