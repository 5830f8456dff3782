package kvevents

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"
)

// A minimal ZMTP 3.0 subscriber (rfc.zeromq.org/spec/23): what the sidecar needs of
// ZeroMQ to hear vLLM's PUB socket, with every length bounded before it is trusted. The
// library it replaces allocated whatever size a frame announced (73 bytes announcing
// 2^62 panicked the sidecar), kept "more" frames without end and held its accept loop
// inside one peer's handshake.
//
// The sidecar listens; vLLM's publisher connects. It greets as ZMTP 3.0 with the NULL
// mechanism, so peers of 3.1 (libzmq, pyzmq) speak 3.0 to it: subscriptions travel as
// messages whose first byte is 1.

const (
	// handshakeTimeout bounds a peer's greeting and READY.
	handshakeTimeout = 10 * time.Second
	// maxFrames bounds a message's frames: vLLM sends 3 (topic, sequence, payload).
	maxFrames = 3
	// maxPublishers bounds the peers at once (the pod's own: vLLM's one publisher, and
	// its next one while the last is going); each holds at most a message.
	maxPublishers = 4
)

var errProtocol = errors.New("ZMTP protocol")

// zmtpSubscriber accepts publishers at a listener and hands their messages (frames,
// in order per publisher) to messages.
type zmtpSubscriber struct {
	ln       net.Listener
	topic    []byte
	messages chan [][]byte
	// refused is told of each publisher connection ended for breaking the protocol or
	// the bounds.
	refused func(error)
}

// listenZMTP listens at addr (host:port) for publishers of topic.
func listenZMTP(addr, topic string, refused func(error)) (*zmtpSubscriber, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	return &zmtpSubscriber{ln: ln, topic: []byte(topic), messages: make(chan [][]byte, 64), refused: refused}, nil
}

// serve accepts publishers until ctx ends; each is read on its own, so that one that
// never greets locks no other out.
func (z *zmtpSubscriber) serve(ctx context.Context) error {
	stop := context.AfterFunc(ctx, func() { z.ln.Close() })
	defer stop()
	slots := make(chan struct{}, maxPublishers)
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		c, err := z.ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		select {
		case slots <- struct{}{}:
		default:
			c.Close() // as many publishers as a pod has, and more
			continue
		}
		wg.Go(func() {
			defer func() { <-slots }()
			defer c.Close()
			stop := context.AfterFunc(ctx, func() { c.Close() })
			defer stop()
			if err := z.read(ctx, c); err != nil && ctx.Err() == nil && !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				z.refused(err)
			}
		})
	}
}

// read greets one publisher, subscribes to the topic, and hands its messages on until it
// goes.
func (z *zmtpSubscriber) read(ctx context.Context, c net.Conn) error {
	r := bufio.NewReader(c)
	_ = c.SetDeadline(time.Now().Add(handshakeTimeout))
	if _, err := c.Write(greeting()); err != nil {
		return err
	}
	peer := make([]byte, 64)
	if _, err := io.ReadFull(r, peer); err != nil {
		return fmt.Errorf("greeting: %w", err)
	}
	if peer[0] != 0xff || peer[9] != 0x7f || peer[10] < 3 || string(bytes.TrimRight(peer[12:32], "\x00")) != "NULL" {
		return fmt.Errorf("%w: a greeting that is not ZMTP 3 with the NULL mechanism", errProtocol)
	}
	if _, err := c.Write(command("READY", readyProperties("SUB"))); err != nil {
		return err
	}
	// The peer's READY, naming its socket type.
	f, err := readFrame(r, 1<<10)
	if err != nil {
		return fmt.Errorf("READY: %w", err)
	}
	if !f.command || !bytes.HasPrefix(f.body, []byte("\x05READY")) {
		return fmt.Errorf("%w: the first command is not READY", errProtocol)
	}
	if t := socketType(f.body[6:]); t != "PUB" && t != "XPUB" {
		return fmt.Errorf("%w: a %q socket, not a publisher", errProtocol, t)
	}
	if _, err := c.Write(frame(0, append([]byte{1}, z.topic...))); err != nil {
		return err
	}
	_ = c.SetDeadline(time.Time{})
	for {
		msg, err := readMessage(c, r)
		if err != nil {
			return err
		}
		if msg == nil {
			continue // a command answered
		}
		select {
		case z.messages <- msg:
		case <-ctx.Done():
			return nil
		}
	}
}

// readMessage reads one message, answering a PING on its way (nil message); its frames
// and their sum are bounded before they are read, and read as they arrive.
func readMessage(c net.Conn, r *bufio.Reader) ([][]byte, error) {
	var frames [][]byte
	budget := int64(maxMessage + 1<<10)
	for {
		f, err := readFrame(r, budget)
		if err != nil {
			return nil, err
		}
		if f.command {
			if len(frames) > 0 {
				return nil, fmt.Errorf("%w: a command inside a message", errProtocol)
			}
			if bytes.HasPrefix(f.body, []byte("\x04PING")) && len(f.body) >= 7 {
				// PONG carries the PING's context, after its TTL.
				if _, err := c.Write(command("PONG", f.body[7:])); err != nil {
					return nil, err
				}
			}
			return nil, nil
		}
		frames = append(frames, f.body)
		budget -= int64(len(f.body))
		if !f.more {
			return frames, nil
		}
		if len(frames) == maxFrames {
			return nil, fmt.Errorf("%w: a message of more than %d frames", errProtocol, maxFrames)
		}
	}
}

type zmtpFrame struct {
	more, command bool
	body          []byte
}

// readFrame reads a frame of at most limit bytes; its body grows as its bytes come, not
// as its size announces.
func readFrame(r *bufio.Reader, limit int64) (zmtpFrame, error) {
	flags, err := r.ReadByte()
	if err != nil {
		return zmtpFrame{}, err
	}
	if flags&^0x07 != 0 {
		return zmtpFrame{}, fmt.Errorf("%w: frame flags %#x", errProtocol, flags)
	}
	var size uint64
	if flags&0x02 != 0 {
		var b [8]byte
		if _, err := io.ReadFull(r, b[:]); err != nil {
			return zmtpFrame{}, err
		}
		size = binary.BigEndian.Uint64(b[:])
	} else {
		b, err := r.ReadByte()
		if err != nil {
			return zmtpFrame{}, err
		}
		size = uint64(b)
	}
	if size > uint64(max(limit, 0)) {
		return zmtpFrame{}, fmt.Errorf("%w: a frame of %d bytes, past the %d left of a message's bound", errProtocol, size, limit)
	}
	var body bytes.Buffer
	if _, err := io.CopyN(&body, r, int64(size)); err != nil {
		return zmtpFrame{}, err
	}
	return zmtpFrame{more: flags&0x01 != 0, command: flags&0x04 != 0, body: body.Bytes()}, nil
}

// greeting is this side's: ZMTP 3.0, NULL, not as-server.
func greeting() []byte {
	g := make([]byte, 64)
	g[0], g[9], g[10], g[11] = 0xff, 0x7f, 3, 0
	copy(g[12:], "NULL")
	return g
}

func frame(flags byte, body []byte) []byte {
	if len(body) > 255 {
		return append(binary.BigEndian.AppendUint64([]byte{flags | 0x02}, uint64(len(body))), body...)
	}
	return append([]byte{flags, byte(len(body))}, body...)
}

func command(name string, data []byte) []byte {
	return frame(0x04, append(append([]byte{byte(len(name))}, name...), data...))
}

func readyProperties(socketType string) []byte {
	b := append([]byte{byte(len("Socket-Type"))}, "Socket-Type"...)
	b = binary.BigEndian.AppendUint32(b, uint32(len(socketType)))
	return append(b, socketType...)
}

// socketType reads the Socket-Type of READY's properties ("" when absent or malformed).
func socketType(props []byte) string {
	for len(props) > 0 {
		n := int(props[0])
		if len(props) < 1+n+4 {
			return ""
		}
		name := string(props[1 : 1+n])
		vn := int(binary.BigEndian.Uint32(props[1+n : 1+n+4]))
		props = props[1+n+4:]
		if vn > len(props) {
			return ""
		}
		if name == "Socket-Type" {
			return string(props[:vn])
		}
		props = props[vn:]
	}
	return ""
}
