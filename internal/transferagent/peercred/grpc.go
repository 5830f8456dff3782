package peercred

import (
	"context"
	"errors"
	"fmt"
	"net"

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
)

// AuthInfo carries a connection's Caller to gRPC handlers (peer.FromContext).
type AuthInfo struct {
	credentials.CommonAuthInfo
	Caller Caller
}

// AuthType implements credentials.AuthInfo.
func (AuthInfo) AuthType() string { return "peercred" }

// FromContext returns the caller of a gRPC call served with Credentials.
func FromContext(ctx context.Context) (Caller, bool) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return Caller{}, false
	}
	info, ok := p.AuthInfo.(AuthInfo)
	return info.Caller, ok
}

// Credentials are server transport credentials for a gRPC server on a Unix socket. They
// exchange no bytes (engines dial with insecure credentials: the kernel, not a
// handshake, says who they are), attach each connection's Caller, and refuse an owner's
// connection beyond its share of Conns.
type Credentials struct {
	Reader Reader
	Conns  *Slots
	// Refused, when set, hears of every connection refused, with a gRPC code's name
	// (gRPC itself only logs it at its own verbosity): operators must see a caller
	// being turned away.
	Refused func(code string, err error)
}

var errServerOnly = errors.New("peercred: server credentials only")

// ServerHandshake reads the caller and takes one of its owner's connection slots, given
// back when the connection closes.
func (c Credentials) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	uc, ok := conn.(*net.UnixConn)
	if !ok {
		return nil, nil, fmt.Errorf("peercred: %T is not a Unix socket", conn)
	}
	caller, err := c.Reader.Of(uc)
	if err != nil {
		return nil, nil, c.refuse("Unauthenticated", err)
	}
	release, ok := c.Conns.Take(caller.Owner())
	if !ok {
		return nil, nil, c.refuse("ResourceExhausted", fmt.Errorf("peercred: %s already holds %d connections, its limit", caller, c.Conns.Limit()))
	}
	return &slotConn{Conn: conn, release: release}, AuthInfo{
		CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.NoSecurity},
		Caller:         caller,
	}, nil
}

func (c Credentials) refuse(code string, err error) error {
	if c.Refused != nil {
		c.Refused(code, err)
	}
	return err
}

// ClientHandshake is not used: engines dial without credentials.
func (Credentials) ClientHandshake(context.Context, string, net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return nil, nil, errServerOnly
}

// Info implements credentials.TransportCredentials.
func (Credentials) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "peercred"}
}

// Clone implements credentials.TransportCredentials; the slots stay shared.
func (c Credentials) Clone() credentials.TransportCredentials { return c }

// OverrideServerName implements credentials.TransportCredentials (deprecated there).
func (Credentials) OverrideServerName(string) error { return nil }

// slotConn gives its owner's slot back when it closes.
type slotConn struct {
	net.Conn
	release func()
}

func (c *slotConn) Close() error {
	c.release()
	return c.Conn.Close()
}
