-- Wireshark dissector for the Checkmate header (docs/protocol.md; checkmate/wire.py is the codec).
--
--   tshark -X lua_script:checkmate/wireshark/checkmate.lua -r capture.pcap -Y checkmate
--   wireshark: copy this file into ~/.local/lib/wireshark/plugins/ (or Help > About > Folders)
--
-- Frames: Ethernet / IPv4 / UDP port 48879 (source or destination: a shadow copy keeps
-- source port 48879 when the switch rewrites its destination) / 32-byte header / payload.
-- The header is big-endian; DATA and REPAIR_DATA elements are little-endian, as a CPU
-- tensor holds them. ACK, NACK, REPAIR_REQUEST and REPAIR_DATA end with a 16-byte HMAC tag
-- (checkmate/auth.py); DATA carries none. Anything checkmate.wire.decode would reject is
-- shown with an expert-info error naming the reason. Tested by tests/test_wireshark.py.

local checkmate = Proto("checkmate", "Checkmate gradient replication")

local HEADER_BYTES = 32
local TAG_BYTES = 16
local MAX_PAYLOAD_BYTES = 8940
local WIRE_VERSION = 1

local msg_types = { [1] = "DATA", [2] = "ACK", [3] = "NACK", [4] = "REPAIR_REQUEST", [5] = "REPAIR_DATA" }
local dtypes = { [0] = "none", [1] = "fp32", [2] = "bf16", [3] = "fp16" }
local itemsize = { [0] = 0, [1] = 4, [2] = 2, [3] = 2 }

local f = checkmate.fields
f.version = ProtoField.uint8("checkmate.version", "Version", base.DEC)
f.msg_type = ProtoField.uint8("checkmate.msg_type", "Message type", base.DEC, msg_types)
f.flags = ProtoField.uint8("checkmate.flags", "Flags", base.HEX)
f.flag_replicate = ProtoField.bool("checkmate.flags.replicate", "REPLICATE", 8, nil, 0x01)
f.flag_retransmit = ProtoField.bool("checkmate.flags.retransmit", "RETRANSMIT", 8, nil, 0x02)
f.flag_last = ProtoField.bool("checkmate.flags.last", "LAST", 8, nil, 0x04)
f.dtype = ProtoField.uint8("checkmate.dtype", "Element type", base.DEC, dtypes)
f.job_id = ProtoField.uint32("checkmate.job_id", "Job", base.DEC)
f.iteration = ProtoField.uint32("checkmate.iteration", "Iteration", base.DEC)
f.bucket_id = ProtoField.uint16("checkmate.bucket_id", "Bucket", base.DEC)
f.sender_rank = ProtoField.uint16("checkmate.sender_rank", "Sender rank", base.DEC)
f.shard_key = ProtoField.uint16("checkmate.shard_key", "Shard key", base.DEC)
f.reserved = ProtoField.uint16("checkmate.reserved", "Reserved", base.HEX)
f.element_offset = ProtoField.uint32("checkmate.element_offset", "Element offset", base.DEC)
f.element_count = ProtoField.uint32("checkmate.element_count", "Element count", base.DEC)
f.sequence = ProtoField.uint32("checkmate.sequence", "Sequence", base.DEC)
f.payload = ProtoField.bytes("checkmate.payload", "Elements")
f.first_element = ProtoField.float("checkmate.first_element", "First element (fp32)")
f.range_start = ProtoField.uint32("checkmate.range.start", "Range start", base.DEC)
f.range_end = ProtoField.uint32("checkmate.range.end", "Range end / count", base.DEC)
f.extra = ProtoField.bytes("checkmate.extra", "Payload")
f.tag = ProtoField.bytes("checkmate.tag", "HMAC tag (16 bytes)")

local e_malformed = ProtoExpert.new("checkmate.malformed", "Malformed Checkmate datagram",
    expert.group.MALFORMED, expert.severity.ERROR)
checkmate.experts = { e_malformed }

checkmate.prefs.port = Pref.uint("UDP port", 48879, "UDP port of Checkmate traffic (source or destination)")

local function malformed(tree, pinfo, why)
    tree:add_proto_expert_info(e_malformed, why)
    pinfo.cols.info:append(" [MALFORMED: " .. why .. "]")
end

function checkmate.dissector(buffer, pinfo, tree)
    local length = buffer:len()
    pinfo.cols.protocol = "Checkmate"
    local subtree = tree:add(checkmate, buffer(), "Checkmate")
    if length < HEADER_BYTES then
        malformed(subtree, pinfo, "truncated: " .. length .. " bytes, the header alone is " .. HEADER_BYTES)
        return length
    end
    local version = buffer(0, 1):uint()
    local msg_type = buffer(1, 1):uint()
    local flags = buffer(2, 1):uint()
    local dtype = buffer(3, 1):uint()
    local count = buffer(24, 4):uint()

    subtree:add(f.version, buffer(0, 1))
    subtree:add(f.msg_type, buffer(1, 1))
    local flag_tree = subtree:add(f.flags, buffer(2, 1))
    flag_tree:add(f.flag_replicate, buffer(2, 1))
    flag_tree:add(f.flag_retransmit, buffer(2, 1))
    flag_tree:add(f.flag_last, buffer(2, 1))
    subtree:add(f.dtype, buffer(3, 1))
    subtree:add(f.job_id, buffer(4, 4))
    subtree:add(f.iteration, buffer(8, 4))
    subtree:add(f.bucket_id, buffer(12, 2))
    subtree:add(f.sender_rank, buffer(14, 2))
    subtree:add(f.shard_key, buffer(16, 2))
    subtree:add(f.reserved, buffer(18, 2))
    subtree:add(f.element_offset, buffer(20, 4))
    subtree:add(f.element_count, buffer(24, 4))
    subtree:add(f.sequence, buffer(28, 4))

    local names = {}
    if bit.band(flags, 0x01) ~= 0 then names[#names + 1] = "REPLICATE" end
    if bit.band(flags, 0x02) ~= 0 then names[#names + 1] = "RETRANSMIT" end
    if bit.band(flags, 0x04) ~= 0 then names[#names + 1] = "LAST" end
    pinfo.cols.info:set(string.format("%s job=%d it=%d bucket=%d rank=%d off=%d n=%d seq=%d%s",
        msg_types[msg_type] or ("type " .. msg_type), buffer(4, 4):uint(), buffer(8, 4):uint(),
        buffer(12, 2):uint(), buffer(14, 2):uint(), buffer(20, 4):uint(), count, buffer(28, 4):uint(),
        #names > 0 and (" [" .. table.concat(names, ",") .. "]") or ""))

    if version ~= WIRE_VERSION then
        malformed(subtree, pinfo, "wire version " .. version .. ", expected " .. WIRE_VERSION)
        return length
    end
    if msg_types[msg_type] == nil then
        malformed(subtree, pinfo, "unknown message type " .. msg_type)
        return length
    end
    if dtypes[dtype] == nil then
        malformed(subtree, pinfo, "unknown dtype " .. dtype)
        return length
    end
    if bit.band(flags, 0xF8) ~= 0 then
        malformed(subtree, pinfo, string.format("flags 0x%02x has unknown bits", flags))
    end
    if buffer(18, 2):uint() ~= 0 then
        malformed(subtree, pinfo, "reserved field is not 0")
    end
    if length > HEADER_BYTES + MAX_PAYLOAD_BYTES then
        malformed(subtree, pinfo, "oversized: " .. length .. " bytes")
    end
    if bit.band(flags, 0x01) ~= 0 and msg_type ~= 1 then
        malformed(subtree, pinfo, "REPLICATE on a " .. msg_types[msg_type] .. " datagram")
    end

    local rest = length - HEADER_BYTES
    local tagged = msg_type ~= 1
    if tagged then
        if rest < TAG_BYTES then
            malformed(subtree, pinfo, "no room for the 16-byte tag")
            return length
        end
        rest = rest - TAG_BYTES
    end
    if msg_type == 1 or msg_type == 5 then
        local expected = count * itemsize[dtype]
        if dtype == 0 or rest ~= expected then
            malformed(subtree, pinfo, string.format("payload is %d bytes but the header announces %d (%d x %s)",
                rest, expected, count, dtypes[dtype]))
        end
        if rest > 0 then
            local elements = subtree:add(f.payload, buffer(HEADER_BYTES, rest))
            if dtype == 1 and rest >= 4 then
                elements:add_le(f.first_element, buffer(HEADER_BYTES, 4))
            end
        end
    elseif msg_type == 2 or msg_type == 3 or msg_type == 4 then
        -- ACK/NACK: element_count (start, end) ranges; REPAIR_REQUEST: optional (offset, count) pairs
        local pairs = math.floor(rest / 8)
        -- (a worker's NACK to a repair request echoes the requested range: count is elements there)
        if (msg_type == 2 and pairs ~= count) or rest % 8 ~= 0 then
            malformed(subtree, pinfo, string.format("%d payload bytes do not hold %s ranges of 8 bytes",
                rest, msg_type == 2 and tostring(count) or "whole"))
        end
        for i = 0, pairs - 1 do
            local at = HEADER_BYTES + 8 * i
            local r = subtree:add(buffer(at, 8), "Range " .. i)
            r:add(f.range_start, buffer(at, 4))
            r:add(f.range_end, buffer(at + 4, 4))
        end
    end
    if tagged then
        subtree:add(f.tag, buffer(length - TAG_BYTES, TAG_BYTES))
    end
    return length
end

local udp_port = DissectorTable.get("udp.port")
udp_port:add(checkmate.prefs.port, checkmate)

function checkmate.prefs_changed()
    udp_port:remove_all(checkmate)
    udp_port:add(checkmate.prefs.port, checkmate)
end
