package handover

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
)

// maxFilesPerMessage is how many descriptors one message carries at most: the kernel refuses
// more than SCM_MAX_FD (253) in one sendmsg.
const maxFilesPerMessage = 250

// maxBatchBytes is about how much JSON one records message carries before the next begins.
const maxBatchBytes = 1 << 20

// maxMessageBytes bounds a message's body: a successor never allocates more for what a peer
// says is coming (the largest record is a connection with two full splice pipes of pending
// bytes, base64-encoded in JSON).
const maxMessageBytes = 64 << 20

// conn frames JSON messages on a Unix stream socket, each with up to maxFilesPerMessage
// descriptors attached (SCM_RIGHTS). A frame is a 4-byte big-endian length and the body; the
// descriptors travel with the frame's first bytes, and the receiver reads exactly the length
// and then exactly the body, so no read ever crosses into the next frame (a plain read of a
// frame's first bytes would drop its descriptors).
type conn struct {
	uc *net.UnixConn
}

// send writes one message with files attached (at most maxFilesPerMessage).
func (c *conn) send(msg any, files []*os.File) error {
	fds := make([]int, len(files))
	for i, f := range files {
		fd, err := rawFD(f)
		if err != nil {
			return fmt.Errorf("hand-over: send: %w", err)
		}
		fds[i] = fd
	}
	return c.sendFDs(msg, fds)
}

// sendFDs writes one message with raw descriptors attached (at most maxFilesPerMessage): the
// holder keeps its sockets as plain descriptors, never registered with Go's network poller.
func (c *conn) sendFDs(msg any, fds []int) error {
	if len(fds) > maxFilesPerMessage {
		return fmt.Errorf("hand-over: %d descriptors in one message (at most %d)", len(fds), maxFilesPerMessage)
	}
	body, err := json.Marshal(msg)
	if err != nil {
		return fmt.Errorf("hand-over: encode message: %w", err)
	}
	if len(body) > maxMessageBytes {
		return fmt.Errorf("hand-over: message of %d bytes (at most %d)", len(body), maxMessageBytes)
	}
	frame := make([]byte, 4+len(body))
	binary.BigEndian.PutUint32(frame, uint32(len(body)))
	copy(frame[4:], body)
	var oob []byte
	if len(fds) > 0 {
		oob = unixRights(fds)
	}
	n, oobn, err := c.uc.WriteMsgUnix(frame, oob, nil)
	if err != nil {
		return fmt.Errorf("hand-over: send: %w", err)
	}
	if oobn != len(oob) {
		return fmt.Errorf("hand-over: send: %d of %d bytes of descriptors sent", oobn, len(oob))
	}
	if n < len(frame) {
		if _, err := c.uc.Write(frame[n:]); err != nil {
			return fmt.Errorf("hand-over: send: %w", err)
		}
	}
	return nil
}

// recv reads one message into msg and returns the files that came with it; the caller owns
// them. On error no file is left open.
func (c *conn) recv(msg any) ([]*os.File, error) {
	var hdr [4]byte
	oob := make([]byte, rightsSpace(maxFilesPerMessage))
	n, oobn, flags, _, err := c.uc.ReadMsgUnix(hdr[:], oob)
	files, perr := parseRights(oob[:oobn])
	if err == nil && n == 0 {
		err = io.EOF
	}
	if err == nil && perr != nil {
		err = perr
	}
	if err == nil && truncated(flags) {
		err = errors.New("hand-over: descriptors truncated (more than the message may carry)")
	}
	if err == nil && n < len(hdr) {
		_, err = io.ReadFull(c.uc, hdr[n:])
	}
	var body []byte
	if err == nil {
		size := binary.BigEndian.Uint32(hdr[:])
		if size > maxMessageBytes {
			err = fmt.Errorf("hand-over: peer announced a message of %d bytes (at most %d)", size, maxMessageBytes)
		} else {
			body = make([]byte, size)
			_, err = io.ReadFull(c.uc, body)
		}
	}
	if err == nil {
		if jerr := json.Unmarshal(body, msg); jerr != nil {
			err = fmt.Errorf("hand-over: decode message: %w", jerr)
		}
	}
	if err != nil {
		closeFiles(files)
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return nil, fmt.Errorf("hand-over: peer closed the connection: %w", err)
		}
		return nil, fmt.Errorf("hand-over: receive: %w", err)
	}
	return files, nil
}

// recordSender sends records in messages of at most maxFilesPerMessage descriptors and about
// maxBatchBytes of JSON, then the end with how many records there were: the one batching of the
// hand-over (sendPackage) and of the listener store (its sendAll and sendKept). The records'
// descriptors are raw; recordSender does not own them.
type recordSender struct {
	c *conn
	// sent, if set, gets each message's descriptors once the message is sent (or failed).
	sent func(fds []int)

	batch []Record
	fds   []int // the queued records' descriptors, in order
	size  int   // about how many bytes of JSON batch is
	total int
}

// add queues r with its descriptors fds (r.NFiles becomes their number), sending the records
// queued before when r would not fit in their message. On error nothing of r is queued.
func (rs *recordSender) add(r Record, fds []int) error {
	if len(fds) > maxFilesPerMessage {
		return fmt.Errorf("hand-over: record %s has %d descriptors (at most %d)", r.Kind, len(fds), maxFilesPerMessage)
	}
	if len(rs.fds)+len(fds) > maxFilesPerMessage || rs.size+len(r.Meta) > maxBatchBytes {
		if err := rs.flush(); err != nil {
			return err
		}
	}
	r.NFiles, r.Files = len(fds), nil
	rs.batch = append(rs.batch, r)
	rs.fds = append(rs.fds, fds...)
	rs.size += len(r.Meta) + 64
	rs.total++
	return nil
}

// flush sends the queued records, if any, in one message.
func (rs *recordSender) flush() error {
	if len(rs.batch) == 0 {
		return nil
	}
	err := rs.c.sendFDs(message{Type: msgRecords, Records: rs.batch}, rs.fds)
	if rs.sent != nil {
		rs.sent(rs.fds)
	}
	rs.batch, rs.fds, rs.size = nil, nil, 0
	return err
}

// end sends the queued records, then the end.
func (rs *recordSender) end() error {
	if err := rs.flush(); err != nil {
		return err
	}
	return rs.c.send(message{Type: msgEnd, Total: rs.total}, nil)
}

// rawFD returns f's descriptor without File.Fd's side effect: Fd puts the descriptor in
// blocking mode, and O_NONBLOCK belongs to the open socket, shared with every process that holds
// it, so a successor's socket would block the predecessor's network poller.
func rawFD(f *os.File) (int, error) {
	if f == nil {
		return -1, errors.New("a record's descriptor is missing")
	}
	rc, err := f.SyscallConn()
	if err != nil {
		return -1, fmt.Errorf("descriptor of %s: %w", f.Name(), err)
	}
	fd := -1
	if err := rc.Control(func(u uintptr) { fd = int(u) }); err != nil {
		return -1, fmt.Errorf("descriptor of %s: %w", f.Name(), err)
	}
	return fd, nil
}

func closeFiles(files []*os.File) {
	for _, f := range files {
		if f != nil {
			_ = f.Close()
		}
	}
}
