package engineapi

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/status"

	"github.com/kvhandoff/kvhandoff/internal/transferagent/session"
	agentv1 "github.com/kvhandoff/kvhandoff/transferagent/api/v1"
)

// Memory socket limits: concurrent connections in all and per owner (a TP8 engine's
// ranks pass their memory at once), and how long a connection may idle.
const (
	maxMemoryConns         = 256
	maxMemoryConnsPerOwner = 16
	memoryIdle             = 10 * time.Second
)

// serveMemory answers the memory socket (agentv1.MemorySocketName; the protocol is
// written down there): it takes one sealed
// memfd per packet for a session and answers with its handle.
func (srv *Server) serveMemory() {
	slots := make(chan struct{}, maxMemoryConns)
	for {
		c, err := srv.memLn.AcceptUnix()
		if err != nil {
			return // closed at shutdown
		}
		caller, err := srv.callers.Of(c)
		if err != nil {
			srv.cfg.Log.Warn("refused a memory socket connection", "err", err)
			srv.cfg.Metrics.Refused.WithLabelValues("memory", "Unauthenticated").Inc()
			c.Close()
			continue
		}
		release, ok := srv.memConns.Take(caller.Owner())
		if !ok {
			srv.cfg.Metrics.Refused.WithLabelValues("memory", "ResourceExhausted").Inc()
			c.Close()
			continue
		}
		select {
		case slots <- struct{}{}:
		default:
			release()
			srv.cfg.Metrics.Refused.WithLabelValues("memory", "ResourceExhausted").Inc()
			c.Close()
			continue
		}
		srv.wg.Add(1)
		go func() {
			defer srv.wg.Done()
			defer func() { <-slots; release() }()
			defer c.Close()
			srv.memoryConn(c, caller.Owner())
		}()
	}
}

func (srv *Server) memoryConn(c *net.UnixConn, owner string) {
	buf := make([]byte, 256)
	oob := make([]byte, unix.CmsgSpace(4*4)) // room to see (and close) a few extra fds
	for {
		_ = c.SetReadDeadline(time.Now().Add(memoryIdle))
		n, oobn, flags, _, err := c.ReadMsgUnix(buf, oob)
		// Fds that came with the packet are the agent's from here on, whatever the packet
		// says: every path either keeps each or closes it.
		fds, perr := receivedFDs(oob[:oobn], flags)
		if err != nil || n == 0 {
			closeFDs(fds)
			return
		}
		answer, pass, golive := srv.deposit(owner, string(buf[:n]), fds, perr)
		var rights []byte
		if len(pass) > 0 {
			rights = unix.UnixRights(pass...)
		}
		_, _, err = c.WriteMsgUnix([]byte(answer), rights, nil)
		if golive != nil {
			golive(err == nil)
		}
		if err != nil {
			return
		}
	}
}

func closeFDs(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// receivedFDs parses the fds that came with a packet; a truncated control message (more
// fds than fit) is refused, and whatever arrived is still returned to be closed.
func receivedFDs(oob []byte, flags int) ([]int, error) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, err
	}
	var fds []int
	for _, m := range msgs {
		got, err := unix.ParseUnixRights(&m)
		if err == nil {
			fds = append(fds, got...)
		}
	}
	if flags&unix.MSG_CTRUNC != 0 {
		return fds, errors.New("too many fds in one packet")
	}
	return fds, nil
}

// deposit checks one packet: the id of a live session of the sender's owner and exactly
// one fd, a sealed memfd or a GPU allocation's (parseDeposit). Every fd that is not kept
// is closed. A doorbell's answer passes fds back (pass), and golive, when set, is told
// whether the answer went out.
func (srv *Server) deposit(owner, id string, fds []int, perr error) (answer string, pass []int, golive func(sent bool)) {
	refuse := func(format string, args ...any) string {
		closeFDs(fds)
		srv.cfg.Metrics.Refused.WithLabelValues("memory", "InvalidArgument").Inc()
		return "error " + fmt.Sprintf(format, args...)
	}
	if perr != nil {
		return refuse("%v", perr), nil, nil
	}
	if id, ok := strings.CutPrefix(id, agentv1.DoorbellPrefix); ok {
		pass, golive, err := srv.attachDoorbell(owner, id, fds)
		if err != nil {
			fds = nil // attachDoorbell kept or closed each
			return refuse("%v", err), nil, nil
		}
		return "ok 0", pass, golive
	}
	if len(fds) != 1 {
		return refuse("pass exactly one fd per packet, got %d", len(fds)), nil, nil
	}
	gpu, id, size, err := parseDeposit(id)
	if err != nil {
		return refuse("%v", err), nil, nil
	}
	s, err := srv.cfg.Sessions.Lookup(id, owner)
	if err != nil {
		return refuse("%s", status.Convert(err).Message()), nil, nil
	}
	if gpu {
		h, err := s.PassGPU(fds[0], size)
		if err != nil {
			return refuse("%v", err), nil, nil
		}
		closeFDs(fds) // the mapping holds the allocation now
		return fmt.Sprintf("ok %d", h), nil, nil
	}
	if _, _, err := session.CheckSealed(fds[0]); err != nil {
		return refuse("%v", err), nil, nil
	}
	h, err := s.Deposit(os.NewFile(uintptr(fds[0]), "memfd"))
	if err != nil {
		return refuse("%v", err), nil, nil
	}
	return fmt.Sprintf("ok %d", h), nil, nil
}

// parseDeposit reads a deposit packet: a session id (a memfd), or CUDAPrefix, a session id
// and a size (a GPU allocation).
func parseDeposit(p string) (gpu bool, id string, size uint64, err error) {
	rest, gpu := strings.CutPrefix(p, agentv1.CUDAPrefix)
	if !gpu {
		return false, p, 0, nil
	}
	id, n, ok := strings.Cut(rest, " ")
	if size, err = strconv.ParseUint(n, 10, 64); !ok || err != nil || size == 0 {
		return true, "", 0, fmt.Errorf("a GPU allocation's packet is %q, the session id, a space and its size in bytes", agentv1.CUDAPrefix)
	}
	return true, id, size, nil
}
