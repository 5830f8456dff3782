package serving

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	kvv1 "github.com/kvhandoff/kvhandoff/api/v1alpha1"
	"github.com/kvhandoff/kvhandoff/test/agentproc"
	"github.com/kvhandoff/kvhandoff/test/simengine"
)

// Demo sends one chat request through the router in push mode and one in pull mode:
// the router binary, simulated engines (Qwen3-32B's KV layout, TP 2) and two transfer
// agents, the KV verified byte for byte by the decode engine. It prints each answer and
// the router's account of the request to w.
func Demo(ctx context.Context, agentBin, routerBin, dir, provider string, w io.Writer) error {
	a, b, err := agentproc.StartPair(agentBin, dir, provider)
	if err != nil {
		return err
	}
	defer a.Stop()
	defer b.Stop()
	l := simengine.Qwen3_32B(2, 64)
	prompt := "Why does push mode cut time to first token? Answer in one line."
	for _, mode := range []kvv1.TransferMode{kvv1.TransferPush, kvv1.TransferPull} {
		st, err := startStack(ctx, mode, l, a, b, routerBin, dir, engineOpts{prefill: func(int) time.Duration { return 50 * time.Millisecond }})
		if err != nil {
			return fmt.Errorf("%s: %w", mode, err)
		}
		err = demoRequest(st, mode, prompt, l, w)
		st.stop()
		if err != nil {
			return fmt.Errorf("%s: %w", mode, err)
		}
		lines, err := st.requests()
		if err != nil {
			return err
		}
		if line, ok := lines["demo-"+strings.ToLower(string(mode))]; ok {
			fmt.Fprintf(w, "  router: outcome %s, prefill leg %.1f ms, decode leg to first byte %.1f ms, TTFT %.1f ms, router-added %.3f ms\n",
				line.Outcome, line.PrefillMs, line.DecodeMs, line.TTFTMs, line.AddedMs)
		}
	}
	return nil
}

func demoRequest(st *stack, mode kvv1.TransferMode, prompt string, l simengine.Layout, w io.Writer) error {
	body, _ := json.Marshal(map[string]any{"model": Model, "max_tokens": 12, "messages": []map[string]string{{"role": "user", "content": prompt}}})
	fmt.Fprintf(w, "  %s: POST %s/v1/chat/completions  %s\n", mode, st.URL, body)
	req, _ := http.NewRequest(http.MethodPost, st.URL+"/v1/chat/completions", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", "demo-"+strings.ToLower(string(mode)))
	resp, err := (&http.Client{Timeout: 60 * time.Second}).Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", resp.Status, data)
	}
	var out struct {
		Choices []struct {
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
		} `json:"choices"`
		Usage struct {
			PromptTokens int `json:"prompt_tokens"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(data, &out); err != nil || len(out.Choices) != 1 {
		return fmt.Errorf("not a chat completion: %s", data)
	}
	kv := (out.Usage.PromptTokens + l.BlockSize - 1) / l.BlockSize * l.BlockSize * l.BytesPerToken()
	fmt.Fprintf(w, "  %s: answer %q\n  %s: %d prompt tokens, %d KiB of KV moved prefill → decode through the agents, verified\n",
		mode, out.Choices[0].Message.Content, mode, out.Usage.PromptTokens, kv>>10)
	return nil
}
