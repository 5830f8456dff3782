package vllmserver

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"time"
)

// respond writes the generated tokens as vLLM's OpenAI server does: one JSON object, or
// server-sent events with one chunk per token, an optional usage chunk and [DONE].
func (s *Server) respond(w http.ResponseWriter, r *http.Request, rq *request, tokens []string, params map[string]any, answered func([]byte)) {
	id, object := "cmpl-"+rq.id, "text_completion"
	if rq.chat {
		id, object = "chatcmpl-"+rq.id, "chat.completion"
	}
	created := time.Now().Unix()
	usage := map[string]int{"prompt_tokens": len(rq.prompt), "completion_tokens": len(tokens), "total_tokens": len(rq.prompt) + len(tokens)}
	pace := func() bool {
		gap := s.cfg.TPOT + time.Duration(s.running.Load())*s.cfg.TPOTPerStream
		if gap <= 0 {
			return r.Context().Err() == nil
		}
		t := time.NewTimer(gap)
		defer t.Stop()
		select {
		case <-t.C:
			return true
		case <-r.Context().Done():
			return false
		}
	}

	if !rq.stream {
		for range tokens[1:] {
			if !pace() {
				return
			}
		}
		choice := map[string]any{"index": 0, "logprobs": nil, "finish_reason": "length", "stop_reason": nil}
		if rq.chat {
			choice["message"] = map[string]any{"role": "assistant", "content": strings.Join(tokens, "")}
		} else {
			choice["text"] = strings.Join(tokens, "")
		}
		resp := map[string]any{"id": id, "object": object, "created": created, "model": s.cfg.Model,
			"choices": []any{choice}, "usage": usage, "kv_transfer_params": params}
		data, _ := json.Marshal(resp)
		answered(data)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(data)
		return
	}

	w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	chunkObject := object
	if rq.chat {
		chunkObject = "chat.completion.chunk"
	}
	send := func(choices []any, extra map[string]any) bool {
		c := map[string]any{"id": id, "object": chunkObject, "created": created, "model": s.cfg.Model, "choices": choices}
		for k, v := range extra {
			c[k] = v
		}
		data, _ := json.Marshal(c)
		if _, err := fmt.Fprintf(w, "data: %s\n\n", data); err != nil {
			return false
		}
		return rc.Flush() == nil
	}
	if rq.chat && !send([]any{map[string]any{"index": 0, "delta": map[string]any{"role": "assistant", "content": ""}, "logprobs": nil,
		"finish_reason": nil}}, nil) {
		return
	}
	for i, tok := range tokens {
		if i > 0 && !pace() {
			return
		}
		var finish any
		if i == len(tokens)-1 {
			finish = "length"
		}
		choice := map[string]any{"index": 0, "logprobs": nil, "finish_reason": finish}
		if rq.chat {
			choice["delta"] = map[string]any{"content": tok}
		} else {
			choice["text"] = tok
		}
		if !send([]any{choice}, nil) {
			return
		}
		if i == 0 {
			answered(nil)
		}
	}
	if rq.usage && !send([]any{}, map[string]any{"usage": usage}) {
		return
	}
	if _, err := fmt.Fprint(w, "data: [DONE]\n\n"); err == nil {
		_ = rc.Flush()
	}
}
